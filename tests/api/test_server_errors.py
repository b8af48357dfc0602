"""Every bad input gets its status and a message naming the image; the next good request works."""

from __future__ import annotations

import io
import re

import grpc
import numpy as np
import pytest
from encoder_client import EncoderClient, EncoderClientError, HashRef
from encoder_client.protocol import encoder_pb2 as pb
from encoder_client.protocol import encoder_pb2_grpc
from PIL import Image

pytestmark = pytest.mark.timeout(120)
# The same tests against two worker processes (--devices cpu,cpu): conftest.pytest_generate_tests.
ALSO_WITH_WORKER_PROCESSES = True
ALSO_WITH_GRPC_PROCESSES = True

PATCH_DIM = 1176
INVALID, NOT_FOUND, EXHAUSTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                 grpc.StatusCode.RESOURCE_EXHAUSTED)


def png(width: int, height: int, seed: int = 0, noise: bool = True) -> bytes:
    if noise:
        pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    else:
        pixels = np.full((height, width, 3), 128, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def patches(grid=(1, 4, 4), dtype=pb.DTYPE_FLOAT32, width=PATCH_DIM, count=None, extra=b"", seed=0) -> pb.Image:
    n = int(np.prod(grid)) if count is None else count
    x = np.random.default_rng(seed).standard_normal((n, width))
    data = (x.astype("<f4") if dtype != pb.DTYPE_UINT8 else (x * 20 + 128).clip(0, 255).astype(np.uint8)).tobytes()
    return pb.Image(patches=pb.Patches(grid_thw=list(grid), dtype=dtype, data=data + extra))


GOOD = patches(seed=123)

# id -> (request, status, message pattern)
CASES = {
    "empty images": (pb.EncodeRequest(), INVALID, r"no images"),
    "unknown patch dtype": (pb.EncodeRequest(images=[GOOD, patches(dtype=99)]), INVALID,
                            r"^image 1: patches dtype: unknown DType value 99"),
    "unspecified patch dtype": (pb.EncodeRequest(images=[patches(dtype=pb.DTYPE_UNSPECIFIED)]), INVALID,
                                r"^image 0: patches dtype is not set"),
    "unknown output dtype": (pb.EncodeRequest(images=[GOOD], output_dtype=42), INVALID,
                             r"output_dtype: unknown DType value 42"),
    "uint8 output dtype": (pb.EncodeRequest(images=[GOOD], output_dtype=pb.DTYPE_UINT8), INVALID,
                           r"output_dtype: DTYPE_UINT8 is not an embedding dtype"),
    "grid of two numbers": (pb.EncodeRequest(images=[pb.Image(patches=pb.Patches(grid_thw=[4, 4]))]), INVALID,
                            r"^image 0: grid_thw must be \[t, h, w\]"),
    "t below 1": (pb.EncodeRequest(images=[GOOD, patches(grid=(0, 4, 4), count=0)]), INVALID,
                  r"^image 1: grid t must be >= 1"),
    "side not divisible by the merge size": (
        pb.EncodeRequest(images=[GOOD, GOOD, patches(grid=(1, 3, 4))]), INVALID,
        r"^image 2: grid h and w must be positive multiples of the spatial merge size 2"),
    "patch count not matching the grid": (pb.EncodeRequest(images=[patches(count=12)]), INVALID,
                                          r"^image 0: .*12 patches of width 1176, the grid has 16"),
    "wrong patch width": (pb.EncodeRequest(images=[patches(width=1000)]), INVALID,
                          r"^image 0: .*1000 values per patch, the model's patch width is 1176"),
    "patch bytes of the wrong length": (pb.EncodeRequest(images=[patches(extra=b"xyz")]), INVALID,
                                        r"^image 0: patches data has 75267 bytes.*needs 75264"),
    "non-image bytes": (pb.EncodeRequest(images=[pb.Image(encoded=b"hello, not an image")]), INVALID,
                        r"^image 0: not a decodable image"),
    "empty encoded bytes": (pb.EncodeRequest(images=[pb.Image(encoded=b"")]), INVALID,
                            r"^image 0: not a decodable image"),
    "truncated image": (pb.EncodeRequest(images=[GOOD, pb.Image(encoded=png(120, 90)[:4000])]), INVALID,
                        r"^image 1: .*(truncated|corrupt)"),
    "header over --max-image-pixels": (
        pb.EncodeRequest(images=[pb.Image(encoded=png(2100, 2100, noise=False))]), EXHAUSTED,
        r"^image 0: .*pixel"),
    "aspect ratio over 200": (pb.EncodeRequest(images=[pb.Image(encoded=png(1000, 4))]), INVALID,
                              r"^image 0: image aspect ratio 250.0.* over the limit of 200"),
    "content_hash not cached": (pb.EncodeRequest(images=[GOOD, pb.Image(content_hash="ab" * 32)]), NOT_FOUND,
                                r"^image 1: content_hash abab.* is not cached"),
    "empty content_hash": (pb.EncodeRequest(images=[pb.Image(content_hash="")]), INVALID,
                           r"^image 0: (content_hash must be|no source set)"),
    "no source": (pb.EncodeRequest(images=[GOOD, pb.Image()]), INVALID, r"^image 1: no source set"),
    "image over --max-batch-tokens": (
        pb.EncodeRequest(images=[patches(grid=(1, 66, 64), dtype=pb.DTYPE_UINT8)]), EXHAUSTED,
        r"^image 0: image has 4224 patches .*--max-batch-tokens 4096"),
    "request_id over 256 characters": (pb.EncodeRequest(request_id="r" * 257, images=[GOOD]), INVALID,
                                       r"^request_id has 257 characters; at most 256"),
    "more images than --max-images-per-request": (
        pb.EncodeRequest(images=[pb.Image(content_hash="ab" * 32)] * 257), INVALID,
        r"^257 images in one request; at most 256 \(--max-images-per-request\)"),
    "sink set": (pb.EncodeRequest(images=[GOOD], sink=pb.Sink(target="prefill-0:9000")),
                 grpc.StatusCode.PERMISSION_DENIED, r"sinks are not enabled.*--allowed-sinks is empty"),
}


@pytest.fixture(scope="module")
def stub(encoder_server):
    with grpc.insecure_channel(encoder_server.target,
                               options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        yield encoder_pb2_grpc.VisionEncoderStub(channel)


def encode(stub, request: pb.EncodeRequest) -> list[pb.EmbeddingChunk]:
    return list(stub.Encode(request, timeout=60))


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_its_status_and_names_the_image(stub, case):
    request, code, pattern = CASES[case]
    with pytest.raises(grpc.RpcError) as info:
        encode(stub, request)
    assert info.value.code() == code, info.value.details()

    assert re.search(pattern, info.value.details()), info.value.details()
    assert "Traceback" not in info.value.details()
    if code == EXHAUSTED:  # the request itself is over a limit: gRPC's pushback says "do not retry"
        assert dict(info.value.trailing_metadata())["grpc-retry-pushback-ms"] == "-1"
    chunks = encode(stub, pb.EncodeRequest(images=[GOOD]))  # the server is still fine
    assert chunks[-1].last and chunks[-1].num_tokens == 4


def test_a_response_stays_near_the_embedding_size_whatever_chunk_size_and_id_the_caller_asks(stub):
    """Each chunk repeats the request id: tiny chunks and a long id must not multiply the response."""
    image = patches(grid=(1, 32, 32), dtype=pb.DTYPE_UINT8, seed=9)
    request = pb.EncodeRequest(request_id="x" * 256, images=[image, image], output_dtype=pb.DTYPE_FLOAT32,
                               max_chunk_bytes=1)
    chunks = encode(stub, request)
    data = sum(len(c.data) for c in chunks)
    assert data == 2 * 256 * 48 * 4  # two 256-token x 48 float32 embeddings
    assert all(len(c.data) > 4096 - 48 * 4 for c in chunks if not c.last)  # the floor, in whole rows
    assert sum(c.ByteSize() for c in chunks) < 1.15 * data


def test_message_over_max_message_bytes_is_resource_exhausted(stub):
    request = pb.EncodeRequest(images=[pb.Image(encoded=b"\0" * (9 << 20))])
    with pytest.raises(grpc.RpcError) as info:
        encode(stub, request)
    assert info.value.code() == EXHAUSTED
    assert re.search(r"larger than max \(\d+ vs\. 8388608\)", info.value.details()), info.value.details()
    assert encode(stub, pb.EncodeRequest(images=[GOOD]))[-1].last


def test_client_reports_the_status_and_the_image(encoder_server):
    with EncoderClient(encoder_server.target, timeout_s=60) as client:
        for images, code, text in [
            ([png(64, 64, seed=1), b"not an image"], INVALID, "image 1: not a decodable image"),
            ([HashRef("cd" * 32)], NOT_FOUND, "image 0: content_hash"),
        ]:
            with pytest.raises(EncoderClientError) as info:
                client.encode(images)
            assert info.value.code == code and text in info.value.details
        assert len(client.encode([png(64, 64, seed=1)])) == 1


