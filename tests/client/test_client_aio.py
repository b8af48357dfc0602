"""AsyncEncoderClient against the fake VisionEncoder and the real tiny server (tests/client_servers.py);
each test runs its own event loop.

Tests that ask for ``target``/``srv`` run against both (``[fake]``, ``[real]``); tests that also ask for
``fake`` use its internals (scripted failures, recorded requests, its delay) and run against the fake only.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import client_servers
import grpc
import ml_dtypes
import numpy as np
import pytest
from client_servers import Server
from encoder_client import AsyncEncoderClient, EncoderClientError, HashRef, content_hash
from encoder_client.testing import (
    FAKE_NAMESPACE,
    Failure,
    FakeVisionEncoder,
    fake_embedding,
    float32_to_bf16_bits,
    serve_fake,
)

FAST_RETRY = client_servers.FAST_RETRY
pytestmark = pytest.mark.timeout(120)

# The fixtures (fake, srv, target, ...) and the fake/real parametrization: tests/client_servers.py.
pytest_generate_tests = client_servers.pytest_generate_tests
fake, server_kind, srv, target, real_model = (client_servers.fake, client_servers.server_kind, client_servers.srv,
                                              client_servers.target, client_servers.real_model)


def test_async_encode_reassembles_in_request_order_and_decodes_bf16(target: str, srv: Server, tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    path.write_bytes(srv.image("png bytes"))
    patches = np.ones((4, 6), np.float32) if srv.is_fake else \
        np.random.default_rng(time.time_ns() % 2**32).standard_normal((4, srv.patch_dim())).astype(np.float32)
    images = [srv.image("one"), path, (patches, (1, 2, 2))]

    async def run():
        async with AsyncEncoderClient(target, timeout_s=30) as client:
            return (await client.encode(images, output_dtype="bfloat16", max_chunk_bytes=16),
                    await client.encode(images, output_dtype="float32"),
                    await client.encode(images, output_dtype="bfloat16", bf16_as="float32"))

    results, f32, widened = asyncio.run(run())
    assert [r.index for r in results] == [0, 1, 2]
    for r, want, image, wide in zip(results, f32, images, widened, strict=True):
        # The fake's values; for the real server, the same server's float32 answer (itself checked).
        srv.assert_embedding(want, path.read_bytes() if isinstance(image, Path) else image)
        reference = fake_embedding(r.content_hash) if srv.is_fake else want.embedding
        bits = float32_to_bf16_bits(reference)
        # The default bf16_as: ml_dtypes.bfloat16, the bits as received; .astype widens them exactly.
        np.testing.assert_array_equal(r.embedding.view(np.uint16), bits)
        np.testing.assert_array_equal(r.embedding.astype(np.float32), (bits.astype(np.uint32) << 16).view(np.float32))
        assert r.dtype == "bfloat16" and r.embedding.dtype == ml_dtypes.bfloat16
        # bf16_as="float32": the client widens them, to the same values.
        assert wide.dtype == "bfloat16" and wide.embedding.dtype == np.float32
        np.testing.assert_array_equal(wide.embedding, r.embedding.astype(np.float32))
        assert r.content_hash == want.content_hash


def test_async_retries_unavailable_only(target: str, fake: FakeVisionEncoder) -> None:
    # Fake only: scripted failures (fake.fail_next), counted by the fake's recorded requests.
    fake.fail_next += [Failure(grpc.StatusCode.UNAVAILABLE, "starting")] * 2
    fake.fail_next.append(Failure(grpc.StatusCode.INVALID_ARGUMENT, "image 0: empty image"))

    async def run():
        async with AsyncEncoderClient(target, retries=5, **FAST_RETRY) as client:
            with pytest.raises(EncoderClientError) as info:
                await client.encode([b"img"])
            return info.value

    err = asyncio.run(run())
    # Two UNAVAILABLE retried, then INVALID_ARGUMENT raised as is, without a further try.
    assert (err.code, err.details) == (grpc.StatusCode.INVALID_ARGUMENT, "image 0: empty image")
    assert fake.encode_calls == 3


def test_async_a_full_queue_comes_with_the_servers_retry_pushback(target: str, fake: FakeVisionEncoder) -> None:
    # Fake only: the trailer the real server sends with a full queue (tests/api/test_server_lifecycle.py).
    fake.fail_next.append(Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full",
                                  trailers=(("grpc-retry-pushback-ms", "1000"),)))

    async def run():
        async with AsyncEncoderClient(target, **FAST_RETRY) as client:
            with pytest.raises(EncoderClientError) as info:
                await client.encode([b"img"])
            return info.value

    err = asyncio.run(run())
    assert (err.code, err.retry_pushback_ms, err.retry_may_pass) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 1000, True)


def test_async_a_stream_that_already_sent_chunks_is_not_retried(target: str, fake: FakeVisionEncoder) -> None:
    # Fake only: scripted failures (fake.fail_next), counted by the fake's recorded requests.
    fake.fail_next.append(Failure(grpc.StatusCode.UNAVAILABLE, "draining", after_chunks=1))

    async def run():
        async with AsyncEncoderClient(target, retries=3, **FAST_RETRY) as client:
            with pytest.raises(EncoderClientError) as info:
                await client.encode([b"a", b"b"], max_chunk_bytes=32)
            return info.value

    assert asyncio.run(run()).code == grpc.StatusCode.UNAVAILABLE
    assert fake.encode_calls == 1


def test_async_a_request_larger_than_grpcs_default_retry_buffer_is_retried(
    target: str, fake: FakeVisionEncoder
) -> None:
    # Fake only: scripted failures (fake.fail_next), counted by the fake's recorded requests.
    image = bytes(range(256)) * (8 * 1024)  # 2 MiB: gRPC's default per-RPC retry buffer is 256 KiB
    fake.fail_next += [Failure(grpc.StatusCode.UNAVAILABLE, "starting")] * 2

    async def run():
        async with AsyncEncoderClient(target, retries=2, **FAST_RETRY) as client:
            return await client.encode([image])

    (r,) = asyncio.run(run())
    assert r.num_tokens == fake_embedding(r.content_hash).shape[0]
    assert fake.encode_calls == 3 and all(req.images[0].encoded == image for req in fake.requests)


def test_async_retries_never_extend_the_deadline(target: str, fake: FakeVisionEncoder) -> None:
    # Fake only: scripted failures (fake.fail_next), counted by the fake's recorded requests.
    fake.fail_next += [Failure(grpc.StatusCode.UNAVAILABLE, "starting")] * 100

    async def run():
        # 4 retries backing off 0.2, 0.4, 0.8, 1.6 s (+-20%) would take 2.4 s or more if they could run
        # past the 0.9 s deadline, which leaves room for a first retry even on a loaded CI machine.
        async with AsyncEncoderClient(target, retries=4, backoff_base_s=0.2, backoff_max_s=4.0) as client:
            start = time.monotonic()  # the call alone: not the channel's set-up and teardown
            with pytest.raises(EncoderClientError) as info:
                await client.encode([b"img"], timeout_s=0.9)
            return info.value, time.monotonic() - start

    err, elapsed = asyncio.run(run())
    assert err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert elapsed < 2.0  # the deadline (and a loaded CI machine), not the 2.4 s or more of all retries
    assert 1 < fake.encode_calls < 5


def test_async_deadline(target: str, fake: FakeVisionEncoder) -> None:
    # Fake only: the fake's delay holds the call at the server for 60 s (the next test: on both).
    fake.delay_s = 60.0  # the server's work: the 0.3 s deadline must end the call long before it

    async def run():
        async with AsyncEncoderClient(target) as client:
            with pytest.raises(EncoderClientError) as info:
                await client.encode([b"slow"], timeout_s=0.3)
            return info.value

    start = time.monotonic()
    assert asyncio.run(run()).code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 10.0  # generous: a loaded 2-core CI machine, and far below 60 s


def test_async_deadline_on_any_server(target: str, srv: Server) -> None:
    # The fake is held 60 s; the real server gets more work than a 1 ms deadline allows.
    if srv.is_fake:
        srv.fake.delay_s = 60.0
    images = [srv.image(f"slow {i}", (448, 448)) for i in range(4)]

    async def run():
        async with AsyncEncoderClient(target) as client:
            with pytest.raises(EncoderClientError) as info:
                await client.encode(images, timeout_s=0.001)
            return info.value

    start = time.monotonic()
    assert asyncio.run(run()).code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 10.0


def test_async_an_unknown_hash_is_not_found(target: str) -> None:
    async def run():
        async with AsyncEncoderClient(target, timeout_s=30) as client:
            with pytest.raises(EncoderClientError) as info:
                await client.encode([HashRef("cd" * 32)])
            return info.value

    err = asyncio.run(run())
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert err.details.startswith("image 0: ") and "is not cached" in err.details


def test_async_lookup_model_info_health(target: str, srv: Server) -> None:
    data = srv.image("img")

    async def run():
        async with AsyncEncoderClient(target, timeout_s=30) as client:
            (r,) = await client.encode([data])
            (hit,) = await client.encode([HashRef(r.content_hash)])
            return (r, hit, await client.lookup([r.content_hash, "f" * 64]), await client.model_info(),
                    await client.health())

    r, hit, cached, info, health = asyncio.run(run())
    assert hit.cache_hit and hit.content_hash == r.content_hash
    assert cached == [True, False]
    assert info.cache_namespace == (FAKE_NAMESPACE if srv.is_fake else srv.model().cache_namespace)
    assert r.content_hash == content_hash(data, info.cache_namespace)
    np.testing.assert_array_equal(hit.embedding, r.embedding)
    srv.assert_embedding(r, data)
    assert health == "SERVING"


def test_async_encode_splits_feature_levels_into_main_and_deepstack() -> None:
    fake = FakeVisionEncoder(feature_levels=2)

    async def run():
        async with AsyncEncoderClient(target) as client:
            return (await client.encode([b"one", b"two"], output_dtype="bfloat16", max_chunk_bytes=32),
                    await client.model_info())

    with serve_fake(fake) as target:
        results, info = asyncio.run(run())
    assert info.feature_levels == 2
    for r in results:
        bits = float32_to_bf16_bits(fake_embedding(r.content_hash, feature_levels=2))
        widened = np.split((bits.astype(np.uint32) << 16).view(np.float32), 2, axis=1)
        np.testing.assert_array_equal(r.embedding, widened[0])
        (deep,) = r.deepstack
        np.testing.assert_array_equal(deep, widened[1])
