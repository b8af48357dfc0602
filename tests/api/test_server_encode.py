"""The real server (subprocess, tiny preset) driven through the client: results, cache, streaming."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from encoder_client import EncoderClient, HashRef
from encoder_client.protocol import encoder_pb2, encoder_pb2_grpc
from PIL import Image

from encoder_service.models import load_vision_model

pytestmark = pytest.mark.timeout(120)
# The same tests against two worker processes (--devices cpu,cpu): conftest.pytest_generate_tests.
ALSO_WITH_WORKER_PROCESSES = True
ALSO_WITH_GRPC_PROCESSES = True

FORWARDS = "encoder_service_forward_batches_total"


@pytest.fixture(scope="module")
def model():
    return load_vision_model("tiny-qwen2.5-vl", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def client(encoder_server):
    with EncoderClient(encoder_server.target, timeout_s=60) as c:
        yield c


def png(seed: int, size=(150, 100)) -> bytes:
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def random_patches(grid, seed: int) -> np.ndarray:
    n = int(np.prod(grid))
    return np.random.default_rng(seed).standard_normal((n, 1176)).astype(np.float32)


def max_rel_err(got: np.ndarray, want: torch.Tensor) -> float:
    want = want.float().numpy()
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def test_patches_embedding_equals_direct_model_encode(client, model):
    grid = (1, 8, 12)
    x = random_patches(grid, 1)
    (r,) = client.encode([(x, grid)])
    (want,) = model.encode(x, [grid])
    assert r.embedding.dtype == np.float32 and r.embedding.shape == (24, 48) and r.dtype == "float32"
    assert r.grid_thw == grid and r.num_tokens == 24 and r.hidden_size == 48
    assert max_rel_err(r.embedding, want) <= 1e-6


def test_encoded_image_embedding_equals_direct_model_encode(client, model):
    data = png(2)
    (r,) = client.encode([data])
    pixels, grid = model.preprocess(data)
    (want,) = model.encode(pixels, [grid])
    assert r.grid_thw == tuple(grid)
    assert max_rel_err(r.embedding, want) <= 1e-6


def test_images_of_one_size_in_turn_each_get_their_own_embedding(client, model):
    # Every new embedding is copied into a buffer the server prepared from the last ones of that
    # size (engine/warm_memory.py) and Pillow reuses its freed blocks: one size sent in turn, each
    # image must still come back as its own, not as rows of the image before it.
    images = [png(4000 + i) for i in range(6)]
    wants = []
    for data in images:
        pixels, grid = model.preprocess(data)
        wants.append(model.encode(pixels, [grid])[0])
    for data, want, other in zip(images, wants, wants[1:] + wants[:1]):
        (r,) = client.encode([data])
        assert max_rel_err(r.embedding, want) <= 1e-6
        assert max_rel_err(r.embedding, other) > 1e-2


def test_second_encode_of_same_image_is_a_cache_hit_and_runs_no_forward(client, encoder_server):
    data = png(3)
    (first,) = client.encode([data])
    forwards = encoder_server.metric(FORWARDS)
    hits = encoder_server.metric("encoder_service_cache_hits_total")
    (second,) = client.encode([data])
    assert not first.cache_hit and second.cache_hit
    assert encoder_server.metric(FORWARDS) == forwards
    assert encoder_server.metric("encoder_service_cache_hits_total") == hits + 1
    assert np.array_equal(first.embedding, second.embedding)
    assert second.content_hash == first.content_hash
    assert client.lookup([first.content_hash, "0" * 64]) == [True, False]
    (by_ref,) = client.encode([HashRef(first.content_hash)])
    assert by_ref.cache_hit and np.array_equal(by_ref.embedding, first.embedding)


def test_16_concurrent_requests_for_the_same_new_image_run_one_forward(encoder_server):
    data = png(4, size=(448, 448))
    forwards = encoder_server.metric(FORWARDS)
    shared = ("encoder_service_inflight_joins_total", "encoder_service_cache_hits_total")
    reused = sum(encoder_server.metric(name) for name in shared)

    def one(_):
        with EncoderClient(encoder_server.target, timeout_s=60) as c:
            return c.encode([data])[0]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert encoder_server.metric(FORWARDS) == forwards + 1
    assert sum(encoder_server.metric(name) for name in shared) == reused + 15
    assert len({r.content_hash for r in results}) == 1
    for r in results:
        assert np.array_equal(r.embedding, results[0].embedding)


def test_three_image_request_streams_chunks_that_reassemble_exactly(encoder_server, client):
    images = [png(10, size=(448, 448)), png(11, size=(420, 280)), png(12, size=(300, 336))]
    expected = client.encode(images)  # reference through the client (cache hits below)
    row_bytes = 48 * 4
    request = encoder_pb2.EncodeRequest(
        request_id="r-3", images=[encoder_pb2.Image(encoded=b) for b in images],
        output_dtype=encoder_pb2.DTYPE_FLOAT32, max_chunk_bytes=21 * row_bytes + 7)  # the 4096 floor + 7
    with grpc.insecure_channel(encoder_server.target) as channel:
        chunks = list(encoder_pb2_grpc.VisionEncoderStub(channel).Encode(request, timeout=60))
    by_image: dict[int, list] = {}
    for c in chunks:
        by_image.setdefault(c.image_index, []).append(c)
        assert c.request_id == "r-3" and len(c.data) <= 21 * row_bytes and len(c.data) % row_bytes == 0
    assert sorted(by_image) == [0, 1, 2]
    for index, parts in by_image.items():
        assert len(parts) > 1  # small chunks: each image spans several
        assert [p.last for p in parts] == [False] * (len(parts) - 1) + [True]
        offsets = [p.token_offset for p in parts]
        assert offsets == [sum(len(q.data) // row_bytes for q in parts[:i]) for i in range(len(parts))]
        head = parts[0]
        assert head.content_hash == expected[index].content_hash and head.hidden_size == 48
        assert list(head.grid_thw) == list(expected[index].grid_thw) and head.cache_hit
        assert parts[-1].HasField("timing")
        rows = np.frombuffer(b"".join(p.data for p in parts), dtype="<f4").reshape(head.num_tokens, 48)
        assert np.array_equal(rows, expected[index].embedding)


def test_output_dtypes_are_the_float32_embedding_cast(client):
    grid = (1, 4, 4)
    x = random_patches(grid, 20)
    (f32,) = client.encode([(x, grid)])
    (f16,) = client.encode([(x, grid)], output_dtype="float16")
    (bf16,) = client.encode([(x, grid)], output_dtype="bfloat16", bf16_as="uint16")
    assert f16.dtype == "float16" and np.array_equal(f16.embedding, f32.embedding.astype(np.float16))
    want_bits = torch.from_numpy(f32.embedding).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert bf16.dtype == "bfloat16" and np.array_equal(bf16.embedding, want_bits)


def test_model_info_health_and_reflection(client, encoder_server):
    info = client.model_info()
    assert info.model_type == "qwen2_5_vl" and info.hidden_size == 48 and info.patch_dim == 1176
    assert info.device in ("cpu", "cpu:0,cpu:1") and info.dtype == "float32" and info.max_batch_tokens == 4096
    assert client.health() == "SERVING"
    # What runs every layer: the attention backend and the fused operations' providers (the CPU: torch).
    assert info.attention_backend == "sdpa"
    assert info.ops == "window_attention=torch,rms_scale=torch,gated_mlp=torch"
    log = encoder_server.log_text()
    assert "tiny-qwen2.5-vl" in log and "dtype float32" in log and "attention backend" in log and "cache" in log
    assert f"attention backend sdpa, ops {info.ops}," in log
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(encoder_server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in reply.list_services_response.service}
    assert {"encoder.v1.VisionEncoder", "grpc.health.v1.Health"} <= names
