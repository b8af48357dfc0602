"""Extra feature levels (Qwen3-VL's deepstack) end to end: the real server (servicer, engine, streaming,
cache, sink push) around a fake model whose rows hold three levels, through the real client."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from encoder_client import EncoderClient, HashRef
from encoder_client.protocol import encoder_pb2, encoder_pb2_grpc
from encoder_client.testing import float32_to_bf16_bits
from in_process_encoder import InProcessEncoder

from encoder_service.benchmarks.reliability.sinks import SinkServer, receiver

pytestmark = pytest.mark.timeout(60)

LEVELS = 3
HIDDEN = 8  # FakeVisionModel's
# 144 tokens of 3 x 8 float32 values: 96-byte rows, 42 to a 4096-byte chunk (the smallest budget).
GRID = (1, 24, 24)
SMALL_CHUNK = 4096
ENCODE_PATH = "/encoder.v1.VisionEncoder/Encode"


@pytest.fixture
def levels_model():
    from fake_model import FakeVisionModel

    return FakeVisionModel(feature_levels=LEVELS)


@pytest.fixture
def encoder(levels_model) -> Iterator[InProcessEncoder]:
    server = InProcessEncoder(levels_model, allowed_sinks="127.0.0.1:*")
    yield server
    server.close()


@pytest.fixture
def client(encoder) -> Iterator[EncoderClient]:
    with EncoderClient(encoder.target, timeout_s=20, retries=0) as c:
        yield c


def image(seed: int, grid=GRID) -> bytes:
    return f"img:{','.join(map(str, grid))}:{seed}".encode()


def model_levels(model, seed: int, grid=GRID) -> list[np.ndarray]:
    """The model's output for an image, one [num_tokens, hidden] array per level."""
    from fake_model import FakeVisionModel

    rows = model.reference(FakeVisionModel.patches(grid, seed)).numpy()
    assert rows.shape[1] == model.spec.feature_levels * HIDDEN
    return np.split(rows, model.spec.feature_levels, axis=1)


def assert_levels(result, expected: list[np.ndarray]) -> None:
    assert (result.num_tokens, result.hidden_size, result.feature_levels) == (expected[0].shape[0], HIDDEN, LEVELS)
    np.testing.assert_array_equal(result.embedding, expected[0])
    assert len(result.deepstack) == LEVELS - 1
    for got, level in zip(result.deepstack, expected[1:], strict=True):
        np.testing.assert_array_equal(got, level)


def raw_chunks(target: str, request: encoder_pb2.EncodeRequest) -> list[bytes]:
    """The Encode response messages exactly as they came over the wire."""
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_stream(ENCODE_PATH, request_serializer=encoder_pb2.EncodeRequest.SerializeToString,
                                    response_deserializer=None)
        return list(call(request, timeout=20))


def test_a_streamed_image_spans_several_chunks_of_whole_three_level_rows(encoder, client, levels_model) -> None:
    results = client.encode([image(1), image(2, (1, 8, 8))], max_chunk_bytes=SMALL_CHUNK)
    assert_levels(results[0], model_levels(levels_model, 1))
    assert_levels(results[1], model_levels(levels_model, 2, (1, 8, 8)))
    chunks = [encoder_pb2.EmbeddingChunk.FromString(raw) for raw in raw_chunks(
        encoder.target, encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=image(1))],
                                                  max_chunk_bytes=SMALL_CHUNK))]
    row_bytes = LEVELS * HIDDEN * 4
    assert len(chunks) == 4  # 144 rows, 42 to a chunk
    for chunk in chunks:
        assert (chunk.feature_levels, chunk.hidden_size, chunk.num_tokens) == (LEVELS, HIDDEN, 144)
        assert len(chunk.data) % row_bytes == 0 and len(chunk.data) <= SMALL_CHUNK
    assert [c.token_offset for c in chunks] == [0, 42, 84, 126]


def test_output_dtype_conversion_converts_every_level(client, levels_model) -> None:
    (r,) = client.encode([image(3)], output_dtype="bfloat16", max_chunk_bytes=SMALL_CHUNK)
    for got, level in zip((r.embedding, *r.deepstack), model_levels(levels_model, 3), strict=True):
        bits = float32_to_bf16_bits(level)
        np.testing.assert_array_equal(got, (bits.astype(np.uint32) << 16).view(np.float32))


def test_a_cache_hit_and_a_hash_first_request_return_the_three_levels(encoder, client, levels_model) -> None:
    expected = model_levels(levels_model, 4)
    (first,) = client.encode([image(4)])
    assert not first.cache_hit
    (hit,) = client.encode([image(4)], max_chunk_bytes=SMALL_CHUNK)
    assert hit.cache_hit
    assert_levels(hit, expected)
    # The cache holds each embedding's full rows: three levels' bytes.
    assert encoder.engine.cache.used_bytes == 144 * LEVELS * HIDDEN * 4
    batches = len(levels_model.batches)
    (by_hash,) = client.encode([HashRef(first.content_hash)])
    (hash_first,) = client.encode([image(4)], hash_first=True, max_chunk_bytes=SMALL_CHUNK)
    assert len(levels_model.batches) == batches  # no forward: both from the cache
    for r in (by_hash, hash_first):
        assert r.cache_hit
        assert_levels(r, expected)


def test_a_sink_push_hands_the_receiver_the_levels_separately(encoder, client, levels_model) -> None:
    sink = SinkServer(receiver())
    try:
        headers = client.encode_to_sink([image(5), image(6, (1, 8, 8))], sink.target, sink_request_id="req-levels",
                                        max_chunk_bytes=SMALL_CHUNK)
        assert [(h.num_tokens, h.hidden_size, h.feature_levels) for h in headers] == [(144, HIDDEN, LEVELS),
                                                                                       (16, HIDDEN, LEVELS)]
        # Acknowledged, so held: the receiver's byte bound counts every level.
        assert sink.receiver.buffered_bytes == (144 + 16) * LEVELS * HIDDEN * 4
        pushed = sink.wait("req-levels")
        assert_levels(pushed[0], model_levels(levels_model, 5))
        assert_levels(pushed[1], model_levels(levels_model, 6, (1, 8, 8)))
        assert sink.receiver.buffered_bytes == 0  # taken: every level's bytes given back
    finally:
        sink.close()


def test_model_info_reports_three_levels_of_one_hidden_size(client) -> None:
    info = client.model_info()
    assert (info.hidden_size, info.feature_levels) == (HIDDEN, LEVELS)


def test_a_model_without_levels_sends_the_same_bytes_as_before_the_field() -> None:
    from fake_model import FakeVisionModel

    model = FakeVisionModel()
    server = InProcessEncoder(model)
    try:
        request = encoder_pb2.EncodeRequest(request_id="r", images=[encoder_pb2.Image(encoded=image(7))],
                                            max_chunk_bytes=SMALL_CHUNK)
        raws = raw_chunks(server.target, request)
        rows = model.reference(FakeVisionModel.patches(GRID, 7)).numpy()
        rows_per_chunk = SMALL_CHUNK // (HIDDEN * 4)
        assert len(raws) == 2
        for n, raw in enumerate(raws):
            chunk = encoder_pb2.EmbeddingChunk.FromString(raw)
            start = n * rows_per_chunk
            stop = min(144, start + rows_per_chunk)
            # The message as the server wrote it before feature_levels existed: the header fields,
            # then the data field.
            header = encoder_pb2.EmbeddingChunk(
                request_id="r", image_index=0, content_hash=chunk.content_hash, grid_thw=list(GRID),
                num_tokens=144, hidden_size=HIDDEN, dtype=encoder_pb2.DTYPE_FLOAT32, token_offset=start,
                last=stop == 144, cache_hit=False)
            if header.last:
                header.timing.CopyFrom(chunk.timing)
            data = rows[start:stop].astype("<f4").tobytes()
            assert raw == header.SerializeToString() + b"\x4a" + _varint(len(data)) + data
        with grpc.insecure_channel(server.target) as channel:
            stub = encoder_pb2_grpc.VisionEncoderStub(channel)
            info = stub.GetModelInfo(encoder_pb2.GetModelInfoRequest())
        assert "feature_levels" not in [field.name for field, _ in info.ListFields()]
        assert EncoderClient  # the client side of this case: tests/client/test_client_reassembly.py
    finally:
        server.close()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def test_the_worker_process_hand_off_sizes_its_buffer_by_whole_rows() -> None:
    """--devices workers copy a batch's packed rows out of shared memory: row_width values each."""
    from fake_model import FakeVisionModel

    from encoder_service.engine.batch_queue import WorkItem
    from encoder_service.engine.handoff import copy_out
    from encoder_service.engine.shared_buffer import SharedBuffer

    model = FakeVisionModel(feature_levels=LEVELS)
    front = model.front()
    grids = [(1, 8, 8), (1, 4, 4)]
    packed = torch.cat([model.reference(FakeVisionModel.patches(g, i)) for i, g in enumerate(grids)])
    buffer = SharedBuffer.create(packed.numel() * 4)
    try:
        torch.frombuffer(buffer.array, dtype=torch.float32, count=packed.numel()).copy_(packed.reshape(-1))
        batch = [WorkItem(payload=None, grid=g, job=None) for g in grids]
        parts = copy_out(buffer, batch, front)
        assert [tuple(p.shape) for p in parts] == [(16, LEVELS * HIDDEN), (4, LEVELS * HIDDEN)]
        torch.testing.assert_close(torch.cat(parts), packed, rtol=0, atol=0)
    finally:
        buffer.close()
