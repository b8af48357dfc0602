"""The streaming path writes chunk wire bytes itself: they must parse to exactly the messages that
protobuf would have built, whatever the dtypes and chunk budget."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from encoder_client.protocol import encoder_pb2

from encoder_service.api import streaming
from encoder_service.api.streaming import embedding_chunks, serialized_chunks
from encoder_service.engine.convert import rows_to_bytes
from encoder_service.engine.types import ImageResult, Timing
from encoder_service.torch_dtypes import torch_dtype


def _result(dtype: torch.dtype, tokens: int = 7, hidden: int = 6) -> ImageResult:
    embedding = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    return ImageResult(3, "ab" * 32, (1, 2, 2 * tokens), embedding, cache_hit=True,
                       timing=Timing(1.5, 2.5, 3.5))


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("max_chunk_bytes", [1, 50, 4 << 20])
def test_serialized_chunks_parse_to_the_protobuf_messages(model_dtype, out_dtype, max_chunk_bytes):
    result = _result(model_dtype)
    model_name = str(model_dtype).removeprefix("torch.")
    kwargs = {"request_id": "req-1", "out_dtype": out_dtype, "model_dtype": model_name,
              "max_chunk_bytes": max_chunk_bytes}
    expected = [c.SerializeToString() for c in embedding_chunks(result, **kwargs)]
    got = list(serialized_chunks(result, **kwargs))
    assert len(got) == len(expected) and len(got) >= 1
    for raw, want in zip(got, expected):
        assert encoder_pb2.EmbeddingChunk.FromString(raw) == encoder_pb2.EmbeddingChunk.FromString(want)
    # Both share the engine's wire bytes: check those against a conversion done here, row by row.
    name = out_dtype or model_name
    sent = b"".join(encoder_pb2.EmbeddingChunk.FromString(raw).data for raw in got)
    n = result.embedding.shape[0]
    assert sent == b"".join(rows_to_bytes(result.embedding, torch_dtype(name), i, i + 1) for i in range(n))


def test_embedding_in_the_wire_dtype_is_sent_from_its_own_memory():
    result = _result(torch.bfloat16)
    embedding = result.embedding
    view = result.wire_bytes("bfloat16")
    assert view.nbytes == embedding.nbytes
    embedding[0, 0] = 42.0  # a view, not a copy: the change shows through
    assert bytes(view[:2]) == embedding[0, :1].view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("out_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("max_chunk_bytes", [100_000, 4 << 20])
def test_chunks_of_embeddings_large_enough_to_be_filled_without_the_gil_parse_the_same(out_dtype, max_chunk_bytes):
    result = _result(torch.float32, tokens=1200, hidden=64)  # 307 KB: past GIL_FREE_MIN_BYTES per chunk
    kwargs = {"request_id": "r" * 256, "out_dtype": out_dtype, "model_dtype": "float32",
              "max_chunk_bytes": max_chunk_bytes}
    expected = [c.SerializeToString() for c in embedding_chunks(result, **kwargs)]
    got = list(serialized_chunks(result, **kwargs))
    assert len(got) == len(expected) and max(len(g) for g in got) > streaming.GIL_FREE_MIN_BYTES
    for raw, want in zip(got, expected):
        assert encoder_pb2.EmbeddingChunk.FromString(raw) == encoder_pb2.EmbeddingChunk.FromString(want)


@pytest.mark.parametrize("out_dtype", [None, "bfloat16"])
def test_rows_of_three_feature_levels_are_chunked_whole_and_say_one_levels_hidden_size(out_dtype):
    embedding = torch.randn(7, 3 * 6, generator=torch.Generator().manual_seed(0))  # 3 levels of hidden 6
    result = ImageResult(3, "ab" * 32, (1, 2, 14), embedding, cache_hit=False, feature_levels=3)
    itemsize = 2 if out_dtype else 4
    kwargs = {"request_id": "req-1", "out_dtype": out_dtype, "model_dtype": "float32",
              "max_chunk_bytes": 2 * 18 * itemsize + 1}  # two whole rows, not three
    expected = [c.SerializeToString() for c in embedding_chunks(result, **kwargs)]
    got = [encoder_pb2.EmbeddingChunk.FromString(raw) for raw in serialized_chunks(result, **kwargs)]
    assert got == [encoder_pb2.EmbeddingChunk.FromString(want) for want in expected]
    assert [c.token_offset for c in got] == [0, 2, 4, 6]
    for chunk in got:
        assert (chunk.hidden_size, chunk.feature_levels, chunk.num_tokens) == (6, 3, 7)
        assert len(chunk.data) % (18 * itemsize) == 0
    data = b"".join(c.data for c in got)
    assert data == rows_to_bytes(embedding, result.embedding.dtype if out_dtype is None
                                 else torch.bfloat16, 0, 7)


def _recording_chunks(count: int, record: dict, delay_s: float = 0.0):
    try:
        for i in range(count):
            time.sleep(delay_s)
            record.setdefault("threads", []).append(threading.get_ident())
            yield bytes([i]) * 8
    finally:
        record["closed_in"] = threading.get_ident()


def test_chunks_built_off_the_event_loop_come_in_order_from_other_threads():
    record: dict = {}

    async def consume():
        with ThreadPoolExecutor(2) as pool:
            return [c async for c in streaming.built_off_loop(_recording_chunks(5, record), pool)]

    got = asyncio.run(consume())
    assert got == [bytes([i]) * 8 for i in range(5)]
    assert threading.get_ident() not in record["threads"]  # the event loop's thread copied none


def test_a_response_stopped_mid_build_leaves_its_chunks_closed_without_touching_a_running_generator():
    # The consumer stops (a cancelled call) while the next chunk is being built in a thread: the
    # generator is closed by that thread once its build is done (closing it from the loop while
    # it runs would raise), so its cache pins and the like are released.
    record: dict = {}

    async def consume_one():
        built = streaming.built_off_loop(_recording_chunks(5, record, delay_s=0.5), pool)
        async with contextlib.aclosing(built):
            async for _ in built:
                break

    with ThreadPoolExecutor(2) as pool:
        asyncio.run(consume_one())
        deadline = time.monotonic() + 5
        while "closed_in" not in record and time.monotonic() < deadline:
            time.sleep(0.01)
    assert record["closed_in"] != threading.get_ident()
    assert len(record["threads"]) == 2  # the first chunk and the one under way; no more built
