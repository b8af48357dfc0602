"""A fake VisionEncoder server, for testing code that uses the client without a GPU or a model.

The fake speaks the wire contract (chunking, completion order, cache hits, Lookup, GetModelInfo,
health) but its embeddings are deterministic pseudo-random numbers derived from the content
hash, not a model's output. ``FakeVisionEncoder(feature_levels=3)`` serves a model with extra
feature levels (rows of main + deepstack levels, as Qwen3-VL). Tests can script failures::

    fake = FakeVisionEncoder()
    fake.fail_next.append(Failure(grpc.StatusCode.UNAVAILABLE, "draining"))
    with serve_fake(fake) as target, EncoderClient(target) as client:
        ...
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health as health_lib
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encoder_client.protocol import BY_ENUM, BY_NAME, WireDType, encoder_pb2, encoder_pb2_grpc, hashing

FAKE_NAMESPACE = "fake-model/ns-1"
FAKE_HIDDEN_SIZE = 8
FAKE_DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


def fake_embedding(content_hash: str, hidden_size: int = FAKE_HIDDEN_SIZE, feature_levels: int = 1) -> np.ndarray:
    """The fake's float32 rows for a content hash: [3..12 tokens, feature_levels * hidden_size], the
    levels side by side as on the wire (``np.split(rows, feature_levels, axis=1)`` separates them)."""
    seed = int(content_hash[:16], 16)
    rng = np.random.default_rng(seed)
    num_tokens = 3 + seed % 10
    return rng.standard_normal((num_tokens, hidden_size * feature_levels)).astype(np.float32)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, rounding to nearest even (as torch does); finite inputs."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def _embedding_dtype(dtype: int) -> WireDType:
    """The wire dtype the fake sends embeddings in: float32 for anything but float16 and bfloat16."""
    wire = BY_ENUM.get(dtype)
    return wire if wire is not None and wire.embedding else BY_NAME["float32"]


def _wire_bytes(embedding: np.ndarray, dtype: int) -> bytes:
    wire = _embedding_dtype(dtype)
    if wire.name == "bfloat16":
        embedding = float32_to_bf16_bits(embedding)
    return embedding.astype(wire.numpy).tobytes()


@dataclass
class Failure:
    """A scripted failure of the next Encode call: abort with code/details (and trailing
    metadata, e.g. ``(("grpc-retry-pushback-ms", "1000"),)``) after some chunks."""

    code: grpc.StatusCode
    details: str
    after_chunks: int = 0
    trailers: tuple[tuple[str, str], ...] = ()


def _abort(context: grpc.ServicerContext, failure: Failure) -> None:
    if failure.trailers:
        context.set_trailing_metadata(failure.trailers)
    context.abort(failure.code, failure.details)


class FakeVisionEncoder(encoder_pb2_grpc.VisionEncoderServicer):
    """In-memory VisionEncoder. Chunks of all images are interleaved, last image first, so a
    client that assumes request order or one image at a time fails against it."""

    def __init__(self, *, hidden_size: int = FAKE_HIDDEN_SIZE, model_dtype: int = encoder_pb2.DTYPE_FLOAT32,
                 cache_namespace: str = FAKE_NAMESPACE, feature_levels: int = 1) -> None:
        self.hidden_size = hidden_size
        self.feature_levels = feature_levels
        self.model_dtype = model_dtype
        self.cache_namespace = cache_namespace
        self.requests: list[encoder_pb2.EncodeRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.fail_next: list[Failure] = []
        self.delay_s = 0.0  # before the first chunk, to exercise deadlines
        self.cached: set[str] = set()
        self._lock = threading.Lock()

    @property
    def encode_calls(self) -> int:
        return len(self.requests)

    def _content_hash(self, index: int, image: encoder_pb2.Image, context: grpc.ServicerContext) -> str:
        source = image.WhichOneof("source")
        if source == "encoded":
            return hashing.hash_encoded(self.cache_namespace, image.encoded)
        if source == "patches":
            p = image.patches
            if len(p.grid_thw) != 3:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"image {index}: grid_thw must have 3 values")
            return hashing.hash_patches(self.cache_namespace, p.grid_thw, p.dtype, p.data)
        if source == "content_hash":
            if image.content_hash not in self.cached:
                context.abort(grpc.StatusCode.NOT_FOUND, f"image {index}: content_hash is not cached")
            return image.content_hash
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"image {index}: no source set")
        raise AssertionError("unreachable")

    def Encode(self, request: encoder_pb2.EncodeRequest, context: grpc.ServicerContext
               ) -> Iterator[encoder_pb2.EmbeddingChunk]:
        with self._lock:
            self.requests.append(request)
            self.metadata.append(dict(context.invocation_metadata()))
            failure = self.fail_next.pop(0) if self.fail_next else None
        if failure is not None and failure.after_chunks == 0:
            _abort(context, failure)
        if not request.images:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request has no images")
        end = time.monotonic() + self.delay_s
        while time.monotonic() < end:
            if not context.is_active():
                return
            time.sleep(0.005)
        dtype = request.output_dtype or self.model_dtype
        itemsize = _embedding_dtype(dtype).itemsize
        chunk_bytes = request.max_chunk_bytes or FAKE_DEFAULT_CHUNK_BYTES
        rows_per_chunk = max(1, chunk_bytes // (self.hidden_size * self.feature_levels * itemsize))
        levels = self.feature_levels if self.feature_levels > 1 else 0  # as the server: 0 means 1
        per_image = []
        for index, image in enumerate(request.images):
            content_hash = self._content_hash(index, image, context)
            embedding = fake_embedding(content_hash, self.hidden_size, self.feature_levels)
            with self._lock:
                cache_hit = content_hash in self.cached
                self.cached.add(content_hash)
            grid = list(image.patches.grid_thw) if image.WhichOneof("source") == "patches" else [1, 2, 2]
            n = embedding.shape[0]
            chunks = []
            for offset in range(0, n, rows_per_chunk):
                rows = embedding[offset:offset + rows_per_chunk]
                last = offset + rows_per_chunk >= n
                chunks.append(encoder_pb2.EmbeddingChunk(
                    request_id=request.request_id, image_index=index, content_hash=content_hash,
                    grid_thw=grid, num_tokens=n, hidden_size=self.hidden_size, dtype=dtype,
                    token_offset=offset, data=_wire_bytes(rows, dtype), last=last, cache_hit=cache_hit,
                    feature_levels=levels,
                    timing=encoder_pb2.ServerTiming(queue_ms=1.0, preprocess_ms=2.0, forward_ms=3.0)
                    if last else None,
                ))
            per_image.append(chunks)
        sent = 0
        # Round-robin over the images, last image first: completion order != request order.
        queues = list(reversed(per_image))
        while any(queues):
            for queue in queues:
                if queue:
                    if failure is not None and sent == failure.after_chunks:
                        _abort(context, failure)
                    yield queue.pop(0)
                    sent += 1

    def Lookup(self, request: encoder_pb2.LookupRequest, context: grpc.ServicerContext
               ) -> encoder_pb2.LookupResponse:
        with self._lock:
            return encoder_pb2.LookupResponse(cached=[h in self.cached for h in request.content_hashes])

    def GetModelInfo(self, request: encoder_pb2.GetModelInfoRequest, context: grpc.ServicerContext
                     ) -> encoder_pb2.ModelInfo:
        return encoder_pb2.ModelInfo(
            model_id="fake/vit", model_type="fake", hidden_size=self.hidden_size, dtype=self.model_dtype,
            patch_size=14, temporal_patch_size=2, spatial_merge_size=2, patch_dim=1176,
            attention_backend="none", ops="none", device="cpu", cache_namespace=self.cache_namespace,
            max_batch_tokens=16384, max_message_bytes=64 * 1024 * 1024, max_image_pixels=12845056,
            version="fake", feature_levels=self.feature_levels if self.feature_levels > 1 else 0,
        )


@contextlib.contextmanager
def serve_fake(servicer: FakeVisionEncoder | None = None, *, health: bool = True) -> Iterator[str]:
    """Run servicer (a new FakeVisionEncoder if None) on a loopback port; yields "127.0.0.1:PORT".

    With ``health``, the standard health service is registered as SERVING.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    encoder_pb2_grpc.add_VisionEncoderServicer_to_server(servicer or FakeVisionEncoder(), server)
    if health:
        health_servicer = health_lib.HealthServicer()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)
