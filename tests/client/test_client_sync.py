"""EncoderClient against the fake VisionEncoder and the real tiny server (tests/client_servers.py).

Tests that ask for ``target``/``client``/``srv`` run against both (``[fake]``, ``[real]``); tests that
also ask for ``fake`` use the fake's internals (recorded requests, scripted failures, its delay) and
run against the fake only.
"""

from __future__ import annotations

import time
from pathlib import Path

import client_servers
import grpc
import ml_dtypes
import numpy as np
import pytest
from client_servers import Server, namespace, png
from encoder_client import EncoderClient, EncoderClientError, HashRef, ModelInfo, content_hash, hashing
from encoder_client.protocol import encoder_pb2, encoder_pb2_grpc
from encoder_client.testing import (
    FAKE_NAMESPACE,
    FakeVisionEncoder,
    fake_embedding,
    float32_to_bf16_bits,
    serve_fake,
)

pytestmark = pytest.mark.timeout(120)

# The fixtures (fake, srv, target, client, ...) and the fake/real parametrization: tests/client_servers.py.
pytest_generate_tests = client_servers.pytest_generate_tests
fake, server_kind, srv, target, real_model, client = (
    client_servers.fake, client_servers.server_kind, client_servers.srv, client_servers.target,
    client_servers.real_model, client_servers.sync_client)


def test_interleaved_chunks_of_several_images_come_back_in_request_order(client: EncoderClient, srv: Server) -> None:
    images = [srv.image("first"), srv.image("second image", (112, 56)), srv.image("third", (56, 84)),
              srv.image("fourth", (140, 56))]
    # One float32 row per chunk (40 bytes for the fake's hidden 8, 200 for the tiny model's 48): every
    # image arrives in several chunks (the fake sends them round-robin, last image first).
    row_bytes = 40 if srv.is_fake else 200
    results = client.encode(images, output_dtype="float32", max_chunk_bytes=row_bytes)
    assert [r.index for r in results] == [0, 1, 2, 3]
    ns = namespace(client)
    for r, data in zip(results, images, strict=True):
        assert r.content_hash == hashing.hash_encoded(ns, data)
        srv.assert_embedding(r, data)
        assert r.embedding.dtype == np.float32 and r.dtype == "float32"
        assert (r.num_tokens, r.hidden_size) == r.embedding.shape and r.num_tokens > 1
        assert r.grid_thw == srv.expected_grid(data)
        if srv.is_fake:
            assert r.timing == {"queue_ms": 1.0, "preprocess_ms": 2.0, "forward_ms": 3.0}
        else:
            assert set(r.timing) == {"queue_ms", "preprocess_ms", "forward_ms"}
            assert all(v >= 0 for v in r.timing.values())
        assert r.latency_ms > 0
        assert not r.cache_hit


def test_max_chunk_bytes_is_sent(fake: FakeVisionEncoder, client: EncoderClient) -> None:
    # Fake only: reads the request the fake recorded.
    client.encode([b"img"], max_chunk_bytes=40)
    assert fake.requests[-1].max_chunk_bytes == 40


def test_bf16_comes_back_as_bfloat16_by_default_or_exact_float32_or_raw_bits(
    client: EncoderClient, srv: Server
) -> None:
    data = srv.image("img")
    (f32,) = client.encode([data], output_dtype="float32")
    (r,) = client.encode([data], output_dtype="bfloat16", max_chunk_bytes=16)
    # The fake's values; for the real server, the same server's float32 answer (itself checked).
    reference = fake_embedding(r.content_hash) if srv.is_fake else f32.embedding
    srv.assert_embedding(f32, data)
    bits = float32_to_bf16_bits(reference)
    # numpy reference: put the 16 bits in the high half of a float32.
    widened = (bits.astype(np.uint32) << 16).view(np.float32)
    # The default: ml_dtypes.bfloat16, the received bits as they are (not widened to float32).
    assert r.dtype == "bfloat16" and r.embedding.dtype == ml_dtypes.bfloat16 and r.embedding.itemsize == 2
    np.testing.assert_array_equal(r.embedding.view(np.uint16), bits)
    np.testing.assert_array_equal(r.embedding.astype(np.float32), widened)
    np.testing.assert_allclose(r.embedding.astype(np.float32), reference, rtol=2**-8)
    (wide,) = client.encode([data], output_dtype="bfloat16", max_chunk_bytes=16, bf16_as="float32")
    assert wide.dtype == "bfloat16" and wide.embedding.dtype == np.float32
    np.testing.assert_array_equal(wide.embedding, widened)
    np.testing.assert_allclose(wide.embedding, reference, rtol=2**-8)
    (raw,) = client.encode([data], output_dtype="bfloat16", bf16_as="uint16")
    assert raw.embedding.dtype == np.uint16
    np.testing.assert_array_equal(raw.embedding, bits)
    with pytest.raises(ValueError, match="bf16_as must be one of bfloat16, float32, uint16"):
        client.encode([data], bf16_as="float16")


def test_float16_and_model_dtype(client: EncoderClient, srv: Server) -> None:
    data = srv.image("img")
    (r,) = client.encode([data], output_dtype="float16")
    assert r.embedding.dtype == np.float16 and r.dtype == "float16"
    want = srv.expected(r, data).astype(np.float16)
    if srv.is_fake:
        np.testing.assert_array_equal(r.embedding, want)
    else:  # the model's float32 answer in float16, to a float16 rounding of the 1e-6 model tolerance
        np.testing.assert_allclose(r.embedding, want, rtol=2**-10, atol=1e-6)
    (default,) = client.encode([data])  # no output_dtype: the model's dtype (float32 for both)
    assert default.dtype == client.model_info().dtype == "float32"
    srv.assert_embedding(default, data)


def test_no_output_dtype_is_sent_as_unspecified(fake: FakeVisionEncoder, client: EncoderClient) -> None:
    # Fake only: reads the request the fake recorded.
    client.encode([b"img"])
    assert fake.requests[-1].output_dtype == encoder_pb2.DTYPE_UNSPECIFIED


def test_each_kind_of_input_becomes_the_right_image_message(
    client: EncoderClient, fake: FakeVisionEncoder, tmp_path: Path
) -> None:
    # Fake only: reads the messages the fake recorded (the next test runs the same inputs on both).
    path = tmp_path / "cat.jpg"
    path.write_bytes(b"\xff\xd8 jpeg bytes")
    patches = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)
    half = patches.astype(np.float16)
    pixels = np.arange(4 * 3, dtype=np.uint8).reshape(4, 3)
    (cached,) = client.encode([b"already cached"])
    images = [b"raw bytes", path, str(path), (patches, (1, 2, 2)), (half, [1, 2, 2]),
              (pixels, (1, 2, 2)), (patches.astype(np.float64), (1, 2, 2)), HashRef(cached.content_hash)]
    results = client.encode(images)
    sent = fake.requests[-1].images
    assert [m.WhichOneof("source") for m in sent] == ["encoded"] * 3 + ["patches"] * 4 + ["content_hash"]
    assert sent[0].encoded == b"raw bytes"
    assert sent[1].encoded == sent[2].encoded == path.read_bytes()
    for msg, array, dtype in [(sent[3], patches, encoder_pb2.DTYPE_FLOAT32),
                              (sent[4], half, encoder_pb2.DTYPE_FLOAT16),
                              (sent[5], pixels, encoder_pb2.DTYPE_UINT8),
                              (sent[6], patches, encoder_pb2.DTYPE_FLOAT32)]:  # float64 goes as float32
        assert list(msg.patches.grid_thw) == [1, 2, 2]
        assert msg.patches.dtype == dtype
        assert msg.patches.data == array.astype(array.dtype.newbyteorder("<")).tobytes()
    assert sent[7].content_hash == cached.content_hash
    # The client's local hash is the server's cache key, for every kind of input.
    for image, r in zip(images, results, strict=True):
        assert content_hash(image, FAKE_NAMESPACE) == r.content_hash
    assert results[7].cache_hit and results[6].content_hash == results[3].content_hash


def test_each_kind_of_input_is_encoded_and_hashed_as_the_server_does(
    client: EncoderClient, srv: Server, tmp_path: Path
) -> None:
    path = tmp_path / "cat.png"
    path.write_bytes(srv.image("cat"))
    rng = np.random.default_rng(int(time.time_ns()) % 2**32)  # fresh patches: a first encode is no cache hit
    patches = rng.standard_normal((4, srv.patch_dim())).astype(np.float32)
    half = rng.standard_normal((4, srv.patch_dim())).astype(np.float16)
    pixels = rng.integers(0, 256, (4, srv.patch_dim()), dtype=np.uint8)
    (cached,) = client.encode([srv.image("already cached")])
    images = [srv.image("raw bytes"), path, str(path), (patches, (1, 2, 2)), (half, [1, 2, 2]),
              (pixels, (1, 2, 2)), (patches.astype(np.float64), (1, 2, 2)), HashRef(cached.content_hash)]
    results = client.encode(images)
    ns = namespace(client)
    # The client's local hash is the server's cache key, for every kind of input.
    for image, r in zip(images, results, strict=True):
        assert content_hash(image, ns) == r.content_hash
    assert results[7].cache_hit and results[6].content_hash == results[3].content_hash
    assert results[1].content_hash == results[2].content_hash
    np.testing.assert_array_equal(results[7].embedding, cached.embedding)
    np.testing.assert_array_equal(results[6].embedding, results[3].embedding)
    for i in (0, 3):
        srv.assert_embedding(results[i], images[i])
    srv.assert_embedding(results[1], path.read_bytes())
    assert [r.grid_thw for r in results[3:7]] == [(1, 2, 2)] * 4


def test_bad_inputs_are_refused_before_anything_is_sent(client: EncoderClient, fake: FakeVisionEncoder) -> None:
    # Fake only: that nothing reached the server is read from the fake's recorded requests.
    patches = np.zeros((4, 6), np.float32)
    with pytest.raises(ValueError, match="image 1: patches have 4 rows but grid"):
        client.encode([b"ok", (patches, (1, 2, 3))])
    with pytest.raises(ValueError, match="three positive integers"):
        client.encode([(patches, (4, 1))])
    with pytest.raises(TypeError, match="image 0: patches dtype int64"):
        client.encode([(patches.astype(np.int64), (1, 2, 2))])
    with pytest.raises(TypeError, match="wrap a single image in a list"):
        client.encode(b"not a list")
    with pytest.raises(ValueError, match="output_dtype"):
        client.encode([b"x"], output_dtype="int8")
    with pytest.raises(FileNotFoundError):
        client.encode(["/nonexistent/cat.jpg"])
    assert client.encode([]) == []
    assert fake.encode_calls == 0


def test_an_invalid_image_is_invalid_argument_naming_it(target: str, srv: Server) -> None:
    # An image with no source set (only a raw stub can send one): any server refuses it, naming it.
    channel = grpc.insecure_channel(target)
    stub = encoder_pb2_grpc.VisionEncoderStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Encode(encoder_pb2.EncodeRequest(
            images=[encoder_pb2.Image(encoded=srv.image("ok")), encoder_pb2.Image()]), timeout=30))
    channel.close()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("image 1: ")
    assert "no source set" in info.value.details()


def test_undecodable_bytes_are_invalid_argument_naming_the_image(client: EncoderClient, srv: Server) -> None:
    if srv.is_fake:  # the fake takes any bytes as an image: nothing to refuse
        assert client.encode([b"ok", b"not an image"])
        return
    with pytest.raises(EncoderClientError) as info:
        client.encode([srv.image("ok"), b"not an image"])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details.startswith("image 1: ")

def test_message_limits_come_from_max_message_bytes(target: str, srv: Server) -> None:
    small = b"x" * 512 if srv.is_fake else png(7, (28, 28), solid=True)
    assert len(small) <= 512
    with EncoderClient(target, max_message_bytes=1024, retries=0, timeout_s=30) as client:
        with pytest.raises(EncoderClientError) as info:
            client.encode([b"x" * 4096])
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.encode([small])  # a small request and reply still pass


def test_lookup_model_info_health(target: str, srv: Server) -> None:
    data = srv.image("img")
    with EncoderClient(target, timeout_s=30) as client:
        (r,) = client.encode([data])
        assert client.lookup([r.content_hash, "0" * 64]) == [True, False]
        assert client.lookup([]) == []
        info = client.model_info()
        assert isinstance(info, ModelInfo)
        if srv.is_fake:
            assert (info.hidden_size, info.dtype, info.cache_namespace) == (8, "float32", FAKE_NAMESPACE)
        else:
            model = srv.model()
            assert (info.hidden_size, info.dtype) == (model.spec.hidden_size, "float32")
            assert info.cache_namespace == model.cache_namespace and info.patch_dim == srv.patch_dim()
        assert client.health() == "SERVING"
        # A second encode of the same image is a cache hit with the same embedding.
        (again,) = client.encode([data])
        assert again.cache_hit and again.content_hash == r.content_hash
        np.testing.assert_array_equal(again.embedding, r.embedding)


def test_metadata_reaches_the_server(target: str, fake: FakeVisionEncoder) -> None:
    # Fake only: reads the metadata the fake recorded.
    with EncoderClient(target, metadata=[("authorization", "Bearer t0k")]) as client:
        client.encode([b"img"])
    assert fake.metadata[-1]["authorization"] == "Bearer t0k"


def test_health_on_a_server_without_the_health_service_is_unimplemented() -> None:
    with serve_fake(health=False) as target, EncoderClient(target) as client, \
            pytest.raises(EncoderClientError) as info:
        client.health()
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED


def test_a_model_with_feature_levels_comes_back_as_main_embedding_and_deepstack() -> None:
    fake = FakeVisionEncoder(feature_levels=3)
    with serve_fake(fake) as target, EncoderClient(target, timeout_s=10) as client:
        # 96 bytes = one float32 row of 3 levels x hidden 8: each image spans several chunks.
        results = client.encode([b"first", b"second image"], output_dtype="float32", max_chunk_bytes=96)
        for r in results:
            levels = np.split(fake_embedding(r.content_hash, feature_levels=3), 3, axis=1)
            assert r.embedding.shape == (r.num_tokens, r.hidden_size) == (levels[0].shape[0], 8)
            np.testing.assert_array_equal(r.embedding, levels[0])
            assert r.feature_levels == 3 and len(r.deepstack) == 2
            for got, expected in zip(r.deepstack, levels[1:], strict=True):
                np.testing.assert_array_equal(got, expected)
        assert client.model_info().feature_levels == 3
        channel = grpc.insecure_channel(target)
        chunks = list(encoder_pb2_grpc.VisionEncoderStub(channel).Encode(encoder_pb2.EncodeRequest(
            images=[encoder_pb2.Image(encoded=b"first")], max_chunk_bytes=96)))
        channel.close()
        assert len(chunks) > 1 and {c.feature_levels for c in chunks} == {3}
        assert {len(c.data) for c in chunks} == {96}


def test_a_model_without_feature_levels_sends_no_field_and_gives_no_deepstack(target: str, srv: Server) -> None:
    data = srv.image("img")
    with EncoderClient(target, timeout_s=30) as client:
        (r,) = client.encode([data])
        assert r.deepstack == () and r.feature_levels == 1
        assert client.model_info().feature_levels == 1
    channel = grpc.insecure_channel(target)
    stub = encoder_pb2_grpc.VisionEncoderStub(channel)
    (chunk,) = stub.Encode(encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=data)]), timeout=30)
    info = stub.GetModelInfo(encoder_pb2.GetModelInfoRequest())
    channel.close()
    assert not chunk.feature_levels and not info.feature_levels


def test_calls_abandoned_mid_stream_leave_nothing_behind(fake: FakeVisionEncoder) -> None:
    """The client reads Encode's stream on the calling thread (gRPC's SingleThreadedUnaryStream); a
    call it cancels before the end (a malformed answer, an interrupt) left its last events queued, ~18
    KiB each for good (+53 MB over 3000 such calls) until the client took them off after cancel()."""
    from encoder_client._request import build_request

    class Abandoned(Exception):
        pass

    def first_chunk_only(chunks):
        next(iter(chunks))
        raise Abandoned

    def resident_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    with serve_fake(fake) as target, EncoderClient(target, shared_memory=False) as client:
        request = build_request([b"image"], output_dtype=None, max_chunk_bytes=None, request_id=None)
        client.encode([b"image"])
        before = resident_mib()
        for _ in range(2000):
            with pytest.raises(Abandoned):
                client._call_encode(request, 30, first_chunk_only)
        assert resident_mib() - before < 12  # 35 MiB without
