"""Receiving pushed embeddings: an ``EmbeddingSink`` servicer for prefill/decode servers (grpc.aio).

A decode server mounts it on its own grpc.aio server and lists its address in the encoders'
``--allowed-sinks``; a request sent to an encoder with ``Sink(target=<this server>, request_id=R)``
then lands here, and the decode server awaits it::

    receiver = EmbeddingSinkReceiver(max_buffered_bytes=1 << 30, request_timeout_s=60)
    receiver.add_to_server(server)                 # server = grpc.aio.server(...)
    ...
    pending = receiver.expect("req-42")            # optional: a handle before the push arrives
    first = await pending.image(0)                 # EncodedImage, as soon as image 0 is complete
    images = await receiver.wait("req-42", timeout_s=30)   # every image, in request order

Each image is an ``EncodedImage``: ``embedding`` [num_tokens, hidden_size] and, for a model with
extra feature levels (Qwen3-VL), ``deepstack``: one [num_tokens, hidden_size] array per extra level,
in order, ready for the LLM's deepstack injection (empty for other models). A bf16 embedding is an
``ml_dtypes.bfloat16`` array, the pushed bytes as they are (``bf16_as``, as for the client); torch takes
it without a copy as ``torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)``.

TLS: the receiver is a servicer, so it speaks whatever the server's port speaks: bind it with
``server.add_secure_port(addr, grpc.ssl_server_credentials(...))`` (``root_certificates`` and
``require_client_auth=True`` to require the encoders' client certificates) and start the encoders
with ``--sink-tls-ca`` (and ``--sink-tls-cert``/``--sink-tls-key``); README "Security" has an example.

How the receiver knows a request is complete: the encoder pushes one ``Push`` stream per request;
every chunk carries ``request_id``, ``image_index`` and ``num_images`` (the request's image count).
The request is complete when all ``num_images`` images are reassembled; the stream must then end
normally (the ``PushAck`` says how many images are held). A stream that ends early is refused
(INVALID_ARGUMENT) and the request stays pending. A new stream for a request that is not complete
(the encoder retrying after UNAVAILABLE) starts its reassembly over; images already complete keep
their results and their repeated chunks are skipped.

Bounds: ``max_buffered_bytes`` caps the embedding bytes held (being reassembled or complete and not
yet taken); a push that would exceed it is refused with RESOURCE_EXHAUSTED. A request that is not
taken (``wait`` / ``release``) within ``request_timeout_s`` of its first appearance is dropped and its
waiters get ``EncoderClientError(DEADLINE_EXCEEDED)``: abandoned requests cannot pile up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import grpc.aio
import numpy as np

from encoder_client._reassembly import Reassembler
from encoder_client.dtypes import BF16_AS, DEFAULT_BF16_AS
from encoder_client.errors import EncoderClientError
from encoder_client.protocol import encoder_pb2, encoder_pb2_grpc
from encoder_client.protocol.chunks import parse_chunk
from encoder_client.protocol.dtypes import dtype_name, wire_numpy_dtype
from encoder_client.types import EncodedImage

DEFAULT_MAX_BUFFERED_BYTES = 1 << 30
DEFAULT_REQUEST_TIMEOUT_S = 120.0
MAX_IMAGES_PER_REQUEST = 65536
SINK_SERVICE = encoder_pb2.DESCRIPTOR.services_by_name["EmbeddingSink"].full_name


@dataclass(frozen=True)
class PushedImage:
    """What the caller of a sink-bound Encode gets per image: the header, the data went to the sink."""

    index: int
    content_hash: str
    grid_thw: tuple[int, ...]
    num_tokens: int
    hidden_size: int
    dtype: str
    cache_hit: bool
    feature_levels: int = 1  # the main embedding plus the deepstack levels the sink received

    @classmethod
    def from_chunk(cls, chunk: encoder_pb2.EmbeddingChunk) -> PushedImage:
        return cls(index=chunk.image_index, content_hash=chunk.content_hash, grid_thw=tuple(chunk.grid_thw),
                   num_tokens=chunk.num_tokens, hidden_size=chunk.hidden_size, dtype=dtype_name(chunk.dtype),
                   cache_hit=chunk.cache_hit, feature_levels=chunk.feature_levels or 1)


def collect_headers(chunks: list[encoder_pb2.EmbeddingChunk], num_images: int) -> list[PushedImage]:
    """The headers of a sink-bound Encode stream, in request order."""
    by_index = {c.image_index: PushedImage.from_chunk(c) for c in chunks if c.last}
    missing = [i for i in range(num_images) if i not in by_index]
    if missing:
        raise EncoderClientError(grpc.StatusCode.INTERNAL,
                                 f"malformed Encode response: no header for images {missing}")
    return [by_index[i] for i in range(num_images)]


@dataclass(eq=False)
class PendingRequest:
    """One request's embeddings as they arrive; awaitables per image and for the whole request."""

    request_id: str
    created_s: float
    _loop: asyncio.AbstractEventLoop
    num_images: int = 0  # 0 until the first chunk says
    results: dict[int, EncodedImage] = field(default_factory=dict)
    buffered_bytes: int = 0
    error: EncoderClientError | None = None
    stream: int = 0  # generation of the newest Push stream; an older one is superseded
    _image_futures: dict[int, asyncio.Future] = field(default_factory=dict)
    _all: asyncio.Future | None = None

    def __post_init__(self) -> None:
        self._all = self._loop.create_future()
        self._all.add_done_callback(_consume)

    @property
    def complete(self) -> bool:
        return self.num_images > 0 and len(self.results) == self.num_images

    async def image(self, index: int) -> EncodedImage:
        """Image ``index`` of the request, once all its chunks arrived."""
        if index in self.results:
            return self.results[index]
        if self.error is not None:
            raise self.error
        if self.num_images and index >= self.num_images:
            raise IndexError(f"request {self.request_id} has {self.num_images} images, not {index + 1}")
        fut = self._image_futures.get(index)
        if fut is None:
            fut = self._image_futures[index] = self._loop.create_future()
            fut.add_done_callback(_consume)
        return await asyncio.shield(fut)

    async def all(self) -> list[EncodedImage]:
        """Every image in request order, once the request is complete."""
        return await asyncio.shield(self._all)

    def _resolve(self, result: EncodedImage) -> None:
        self.results[result.index] = result
        fut = self._image_futures.get(result.index)
        if fut is not None and not fut.done():
            fut.set_result(result)
        if self.complete and not self._all.done():
            self._all.set_result([self.results[i] for i in range(self.num_images)])

    def _fail(self, error: EncoderClientError) -> None:
        self.error = error
        for fut in [*self._image_futures.values(), self._all]:
            if not fut.done():
                fut.set_exception(error)


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # an error nobody awaited is not worth asyncio's warning


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class EmbeddingSinkReceiver(encoder_pb2_grpc.EmbeddingSinkServicer):
    """The EmbeddingSink servicer (grpc.aio). Create and use it on the server's event loop.

    ``bf16_as`` as for ``EncoderClient.encode``: bf16 images are held and returned as
    ``ml_dtypes.bfloat16`` arrays by default (2 bytes a value, no conversion), as float32 with
    ``"float32"`` (4 bytes a value, counted so against ``max_buffered_bytes``) or as ``"uint16"`` bits."""

    def __init__(self, *, max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, bf16_as: str = DEFAULT_BF16_AS) -> None:
        if max_buffered_bytes <= 0 or request_timeout_s <= 0:
            raise ValueError("max_buffered_bytes and request_timeout_s must be > 0")
        if bf16_as not in BF16_AS:
            raise ValueError(f"bf16_as must be one of {', '.join(BF16_AS)}, got {bf16_as!r}")
        self.max_buffered_bytes = max_buffered_bytes
        self.request_timeout_s = request_timeout_s
        self.bf16_as = bf16_as
        self.buffered_bytes = 0
        self._requests: dict[str, PendingRequest] = {}
        self._janitor: asyncio.Task | None = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        # The generated registration, but each pushed chunk's rows are read in place (not copied by
        # protobuf): see encoder_client.protocol.chunks.
        handlers = {"Push": grpc.stream_unary_rpc_method_handler(
            self.Push, request_deserializer=parse_chunk,
            response_serializer=encoder_pb2.PushAck.SerializeToString)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SINK_SERVICE, handlers),))
        server.add_registered_method_handlers(SINK_SERVICE, handlers)

    # --- the decode server's side --------------------------------------------------------------------
    def expect(self, request_id: str) -> PendingRequest:
        """The handle of request_id (created now if no chunk has come yet)."""
        if not request_id:
            raise ValueError("request_id must not be empty")
        pending = self._requests.get(request_id)
        if pending is None:
            loop = asyncio.get_running_loop()
            pending = self._requests[request_id] = PendingRequest(request_id, time.monotonic(), loop)
            self._start_janitor()
        return pending

    async def wait(self, request_id: str, *, timeout_s: float | None = None) -> list[EncodedImage]:
        """Every image of request_id in request order; the request is released (bytes freed) after."""
        pending = self.expect(request_id)
        try:
            return await asyncio.wait_for(pending.all(), timeout_s)
        except asyncio.TimeoutError:
            raise EncoderClientError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"request {request_id}: embeddings not complete after {timeout_s} s "
                                     f"({len(pending.results)} of {pending.num_images or '?'} images)") from None
        finally:
            if pending.complete or pending.error is not None:
                self.release(request_id)

    def release(self, request_id: str) -> None:
        """Drops request_id and frees its bytes (waiters still pending get CANCELLED)."""
        pending = self._requests.pop(request_id, None)
        if pending is not None:
            self.buffered_bytes -= pending.buffered_bytes
            pending.buffered_bytes = 0
            if not pending.complete:
                pending._fail(EncoderClientError(grpc.StatusCode.CANCELLED, f"request {request_id} released"))

    @property
    def pending_requests(self) -> int:
        return len(self._requests)

    # --- the encoder's side: Push ------------------------------------------------------------------
    async def Push(self, request_iterator: AsyncIterator[encoder_pb2.EmbeddingChunk],
                   context: grpc.aio.ServicerContext) -> encoder_pb2.PushAck:
        try:
            return await self._receive(request_iterator)
        except _Abort as exc:
            await context.abort(exc.code, exc.details)
        raise AssertionError("unreachable: context.abort raises")

    async def _receive(self, chunks: AsyncIterator[encoder_pb2.EmbeddingChunk]) -> encoder_pb2.PushAck:
        pending: PendingRequest | None = None
        reassembler: Reassembler | None = None
        generation = 0
        async for chunk in chunks:
            if pending is None:
                pending, reassembler, generation = self._start_stream(chunk)
            if pending.stream != generation:
                raise _Abort(grpc.StatusCode.ABORTED, f"request {pending.request_id}: a newer push replaced this one")
            if chunk.request_id != pending.request_id or chunk.num_images != pending.num_images:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             "every chunk of a push must carry the same request_id and num_images")
            if chunk.image_index in pending.results:
                continue  # a retried push repeats images that are already complete
            if chunk.token_offset == 0 and chunk.image_index not in reassembler._partials:
                self._reserve(pending, chunk)
            try:
                result = reassembler.add(chunk)
            except EncoderClientError as exc:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, exc.details.replace("Encode response", "push")) from None
            if result is not None:
                pending._resolve(result)
        if pending is None:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "empty push: no chunks")
        if not pending.complete:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"request {pending.request_id}: push ended with {len(pending.results)} of "
                         f"{pending.num_images} images")
        return encoder_pb2.PushAck(images=pending.num_images)

    def _start_stream(self, chunk: encoder_pb2.EmbeddingChunk) -> tuple[PendingRequest, Reassembler, int]:
        if not chunk.request_id:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "pushed chunk without request_id")
        if not 0 < chunk.num_images <= MAX_IMAGES_PER_REQUEST:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"pushed chunk with num_images {chunk.num_images} (1..{MAX_IMAGES_PER_REQUEST})")
        pending = self.expect(chunk.request_id)
        if pending.num_images and pending.num_images != chunk.num_images:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"request {chunk.request_id} was pushed with {pending.num_images} images, now "
                         f"{chunk.num_images}")
        if pending.error is not None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"request {chunk.request_id} was dropped: {pending.error.details}")
        pending.num_images = chunk.num_images
        pending.stream += 1
        # A retried push starts over: bytes reserved for images still incomplete are given back.
        kept = sum(r.nbytes for r in pending.results.values())
        self.buffered_bytes -= pending.buffered_bytes - kept
        pending.buffered_bytes = kept
        reassembler = Reassembler(pending.num_images, bf16_as=self.bf16_as, started_s=time.monotonic())
        return pending, reassembler, pending.stream

    def _reserve(self, pending: PendingRequest, chunk: encoder_pb2.EmbeddingChunk) -> None:
        try:
            itemsize = np.dtype(wire_numpy_dtype(chunk.dtype)).itemsize
        except ValueError:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported dtype {chunk.dtype}") from None
        if chunk.dtype == encoder_pb2.DTYPE_BFLOAT16 and self.bf16_as == "float32":
            itemsize = 4
        nbytes = chunk.num_tokens * chunk.hidden_size * (chunk.feature_levels or 1) * itemsize
        if self.buffered_bytes + nbytes > self.max_buffered_bytes:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"sink buffer full: {self.buffered_bytes} + {nbytes} bytes over "
                         f"max_buffered_bytes {self.max_buffered_bytes}")
        self.buffered_bytes += nbytes
        pending.buffered_bytes += nbytes

    # --- cleanup of abandoned requests -----------------------------------------------------------
    def _start_janitor(self) -> None:
        if self._janitor is None or self._janitor.done():
            self._janitor = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        interval = min(1.0, self.request_timeout_s / 4)
        while self._requests:
            await asyncio.sleep(interval)
            self.sweep()

    def sweep(self, now_s: float | None = None) -> int:
        """Drops requests older than request_timeout_s; returns how many were dropped."""
        now_s = time.monotonic() if now_s is None else now_s
        expired = [p for p in self._requests.values() if now_s - p.created_s > self.request_timeout_s]
        for pending in expired:
            self._requests.pop(pending.request_id, None)
            self.buffered_bytes -= pending.buffered_bytes
            pending.buffered_bytes = 0
            pending._fail(EncoderClientError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"request {pending.request_id} dropped after {self.request_timeout_s} s "
                f"({len(pending.results)} of {pending.num_images or '?'} images received, not taken)"))
        return len(expired)

    async def close(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._janitor
