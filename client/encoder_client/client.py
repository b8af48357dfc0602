"""The synchronous client (one grpc channel, thread-safe like the channel it wraps)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.experimental
from grpc_health.v1 import health_pb2

from encoder_client._reassembly import Reassembler, check_lookup_response, reassembling
from encoder_client._request import build_request
from encoder_client._rpc import ClientBase, address_to_sink, check_bf16_as, health_status_name, lookup_request
from encoder_client.dtypes import DEFAULT_BF16_AS
from encoder_client.errors import EncoderClientError
from encoder_client.hash_first import HashFirstPlan, is_eviction_race
from encoder_client.protocol import ModelInfo, encoder_pb2
from encoder_client.sink import PushedImage, collect_headers
from encoder_client.types import EncodedImage, ImageInput

_Resp = TypeVar("_Resp")


class EncoderClient(ClientBase):
    """Client of the VisionEncoder service.

    ``timeout_s`` is the default deadline of each call (None: no deadline), retries included;
    ``retries`` is how many times a call is sent again after UNAVAILABLE (never after any other
    code, and never once part of a response has arrived; at most 4, gRPC's limit), after
    ``backoff_base_s`` doubling up to ``backoff_max_s``: gRPC's own retry policy, set in the
    channel's service config (see ``_rpc.RetryPolicy``). ``credentials`` makes the channel a
    secure one (``encoder_client.tls_credentials``); ``metadata`` is sent with every call, and
    ``token`` adds ``authorization: Bearer <token>`` to it (the server's ``--auth-token-file``).
    ``shared_memory``: have the server write embeddings into this process's shared memory instead
    of the stream (it must be on the server's host; the server needs ``--shared-memory on``, its
    default). ``"auto"`` (the default) does so for a target on this host and streams elsewhere, or
    from the first call the server cannot serve that way on; ``True`` always, an error where it
    cannot; ``False`` never. Regions start at ``shared_memory_bytes`` and are sized as calls need
    (see ``encoder_client.shared_memory``).
    """

    _channels = grpc
    # Encode's stream is read on the calling thread itself. gRPC's default sync stream needs a
    # "channel spin" thread, and starts a new one for every call made while no other is running: a
    # client making one call at a time paid a thread's start (and the wait for it) per call
    # (py-spy: a quarter of a sequential client's time on a cache hit; -0.26 ms a lone 448x448 hit,
    # 2.9 -> 2.7 ms, on the CPU host). Retries, deadlines and cancel() are the C core's, as before.
    _surface_options = ((grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),)

    def __enter__(self) -> EncoderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()
        if self._regions is not None:
            self._regions.close()

    def encode(
        self,
        images: Sequence[ImageInput],
        *,
        output_dtype: str | None = None,
        max_chunk_bytes: int | None = None,
        timeout_s: float | None = None,
        bf16_as: str = DEFAULT_BF16_AS,
        request_id: str | None = None,
        hash_first: bool = False,
    ) -> list[EncodedImage]:
        """Encode images; one EncodedImage per image, in request order.

        ``output_dtype`` None means the model's dtype. bf16 embeddings come back as they came, without
        a copy: arrays of dtype ``ml_dtypes.bfloat16`` (``bf16_as="bfloat16"``, the default;
        ``.astype(np.float32)`` widens them exactly); ``bf16_as="float32"`` widens them here (a copy of
        twice the bytes) and ``"uint16"`` gives their raw bit patterns. ``timeout_s`` None means
        the client's default. ``hash_first``: hash locally, ask Lookup, send pixels only for the
        images the server does not cache (see ``encoder_client.hash_first``).
        """
        kwargs = {"output_dtype": output_dtype, "max_chunk_bytes": max_chunk_bytes, "timeout_s": timeout_s,
                  "bf16_as": bf16_as, "request_id": request_id}
        if not hash_first:
            return self._encode(images, **kwargs)
        plan = HashFirstPlan.build(images, self.cache_namespace())
        cached = self.lookup(plan.lookup_hashes, timeout_s=timeout_s) if plan.lookup_indices else []
        send, replaced = plan.to_send(cached)
        try:
            return self._encode(send, **kwargs)
        except EncoderClientError as err:
            if not is_eviction_race(err, replaced):
                raise
            return self._encode(plan.images, **kwargs)  # evicted since Lookup: send the pixels

    def encode_to_sink(
        self,
        images: Sequence[ImageInput],
        sink_target: str,
        *,
        sink_request_id: str | None = None,
        output_dtype: str | None = None,
        max_chunk_bytes: int | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> list[PushedImage]:
        """Encode images and have the server push the embeddings to ``sink_target`` (an
        EmbeddingSink, e.g. ``encoder_client.sink.EmbeddingSinkReceiver`` on a decode server), filed
        under ``sink_request_id`` (default: the request id). Returns each image's header in request
        order once the sink acknowledged every image; the data never comes back here."""
        request = build_request(images, output_dtype=output_dtype, max_chunk_bytes=max_chunk_bytes,
                                request_id=request_id)
        address_to_sink(request, sink_target, sink_request_id)
        if not request.images:
            return []
        chunks = self._call_encode(request, timeout_s, lambda call: list(call))
        return collect_headers(chunks, len(request.images))

    def cache_namespace(self) -> str:
        """The server's cache_namespace (asked once: it is fixed for a server's life)."""
        if self._cache_namespace is None:
            self._cache_namespace = self.model_info().cache_namespace
        return self._cache_namespace

    def _encode(
        self,
        images: Sequence[ImageInput],
        *,
        timeout_s: float | None,
        bf16_as: str,
        **request_kwargs: Any,  # build_request's: output_dtype, max_chunk_bytes, request_id
    ) -> list[EncodedImage]:
        check_bf16_as(bf16_as)
        request = build_request(images, **request_kwargs)
        if not request.images:
            return []
        if not self._socket_asked:
            self._ask_region_socket(timeout_s)
        # gRPC retries an attempt that failed UNAVAILABLE before any response arrived (see
        # RetryPolicy); this call's iteration sees only the attempt that answered.
        try:
            with reassembling(request, bf16_as=bf16_as, regions=self._regions) as reassembler:
                return self._call_encode(request, timeout_s, lambda chunks: _reassemble(reassembler, chunks))
        except (EncoderClientError, OSError) as err:
            if not self._stream_from_now_on(err, lent_registered=bool(request.output_region.handle)):
                raise
        request.ClearField("output_region")
        with reassembling(request, bf16_as=bf16_as, regions=None) as reassembler:
            return self._call_encode(request, timeout_s, lambda chunks: _reassemble(reassembler, chunks))

    def _ask_region_socket(self, timeout_s: float | None) -> None:
        # One thread asks; the others' calls go on meanwhile (with /dev/shm objects), not waiting.
        if not self._socket_lock.acquire(blocking=False):
            return
        try:
            if self._socket_asked:
                return
            try:
                info = self.model_info(timeout_s=timeout_s)
            except EncoderClientError as err:
                if err.code.name in self._ASK_AGAIN:
                    return
                info = None
            self._use_region_socket(info)
        finally:
            self._socket_lock.release()

    def _call_encode(self, request: encoder_pb2.EncodeRequest, timeout_s: float | None,
                     consume: Callable[[Any], _Resp]) -> _Resp:
        """One Encode stream (retried by gRPC on UNAVAILABLE while nothing of it has arrived)."""
        call = self._encode_rpc(request, timeout=self._timeout(timeout_s), metadata=self._metadata)
        try:
            return consume(call)
        except grpc.RpcError as err:
            raise EncoderClientError.from_rpc_error(err) from err
        except BaseException:
            call.cancel()  # stop the server's work for a response nobody will read
            _finish_cancelled(call)
            raise

    def lookup(self, content_hashes: Sequence[str], *, timeout_s: float | None = None) -> list[bool]:
        """Which of content_hashes the server caches now (a hint: entries may be evicted later)."""
        request = lookup_request(content_hashes)
        response = self._unary(self._stub.Lookup, request, timeout_s)
        return check_lookup_response(request, response)

    def model_info(self, *, timeout_s: float | None = None) -> ModelInfo:
        """What the server runs, including the cache_namespace for computing content hashes."""
        return ModelInfo.from_proto(self._unary(self._stub.GetModelInfo, encoder_pb2.GetModelInfoRequest(),
                                                timeout_s))

    def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN".

        A server without the health service raises EncoderClientError(UNIMPLEMENTED).
        """
        response = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout_s)
        return health_status_name(response)

    def _unary(self, method: Callable[..., _Resp], request: Any, timeout_s: float | None) -> _Resp:
        try:
            return method(request, timeout=self._timeout(timeout_s), metadata=self._metadata)
        except grpc.RpcError as err:
            raise EncoderClientError.from_rpc_error(err) from err


def _finish_cancelled(call: Any) -> None:
    """Takes a cancelled stream's last events off its queue. A stream read on the calling thread
    (SingleThreadedUnaryStream) leaves them there when nobody reads it to the end, and each such
    call kept ~18 KiB for good (3000 abandoned calls: +49 MB). gRPC offers no public way; without
    these attributes (another gRPC) nothing is done."""
    state, consume = getattr(call, "_state", None), getattr(call, "_consume_next_event", None)
    if state is None or consume is None:
        return
    with contextlib.suppress(Exception):
        for _ in range(16):  # a cancelled call has a few due operations, all completing now
            if not state.due:
                return
            consume()


def _reassemble(reassembler: Reassembler, chunks: Any) -> list[EncodedImage]:
    for chunk in chunks:
        reassembler.add(chunk)
    return reassembler.results()
