"""Pushing a request's embeddings to an EmbeddingSink (a prefill/decode server), bounded in time.

One ``Push`` stream per request: every image's chunks, tagged with the sink's request_id and the
request's ``num_images``, then the end of the stream; the sink's ``PushAck`` says how many images
it holds. On UNAVAILABLE (the sink restarting, a connection reset) the stream is opened again after
a backoff and everything pushed so far is sent again (the receiver starts that request over), so
the pushed chunks stay in memory until the ack: one request's embeddings, which the cache holds
anyway.

Every push is bounded by ``--sink-timeout-s`` (and the caller's deadline), whatever the sink does:
refuse, stall, never acknowledge. Any failure is answered with one uniform UNAVAILABLE once the
bound has passed: a sink pattern that admits many addresses must not let callers tell a closed port
(refused at once) from a filtered one (a connect timeout) or a gRPC server of another kind (an
error in milliseconds). The real reason goes to the log and to
``encoder_service_sink_push_failures_total{pattern, reason}``; the pattern, not the target, is the
label, so callers cannot add series.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence

import grpc
from encoder_client.protocol import encoder_pb2, encoder_pb2_grpc
from prometheus_client import Counter

from ..errors import EncoderError, Unavailable
from .validation import SinkSpec

log = logging.getLogger(__name__)

# What an operation on a Push call (opening, write, done_writing, awaiting the ack) may raise when the
# sink fails: grpc.RpcError (the call's status), asyncio.InvalidStateError (a write to a call already
# ended), and grpc.aio.BaseError, the public base of grpc's own cygrpc errors: UsageError and
# InternalError, whose ExecuteBatchError is what done_writing() raises when the sink went away as the
# stream was closed (its SendCloseFromClientOperation failed; write() turns the same into a status,
# done_writing() does not). Each goes through _after_failure: retried while the bound allows, then
# UNAVAILABLE, never an unmapped error (INTERNAL) to the caller.
_CALL_ERRORS = (grpc.RpcError, grpc.aio.BaseError, asyncio.InvalidStateError)

SINK_BACKOFF_BASE_S = 0.1
SINK_BACKOFF_MAX_S = 2.0


def sink_backoff_max_s(push_bound_s: float | None) -> float:
    """The longest wait between two tries at a sink: at most a quarter of one push's bound
    (--sink-timeout-s), so that a sink back from a restart is reached within that bound."""
    return SINK_BACKOFF_MAX_S if push_bound_s is None else min(SINK_BACKOFF_MAX_S, push_bound_s / 4)

# A decode server's gRPC receive limit is 4 MiB unless it raised it: a pushed chunk (data plus
# header) stays under that whatever --max-chunk-bytes says.
PUSH_MAX_CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024
# Channels nobody pushed through for this long are closed; past MAX_CHANNELS open ones, the least
# recently used idle one is closed first (a broad pattern admits thousands of targets).
SINK_IDLE_CLOSE_S = 300.0
SINK_MAX_CHANNELS = 256


class SinkFailed(EncoderError):
    """A push that did not end in the sink's correct ack; ``reason`` is for the log and the metric only."""

    code = "UNAVAILABLE"

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class SinkChannels:
    """One grpc.aio channel per sink target, shared by every request pushing there; idle ones closed."""

    def __init__(self, max_message_bytes: int, credentials: grpc.ChannelCredentials | None = None, *,
                 idle_close_s: float = SINK_IDLE_CLOSE_S, max_channels: int = SINK_MAX_CHANNELS,
                 push_bound_s: float | None = None) -> None:
        self._credentials = credentials  # None: plaintext; else TLS (or mTLS) toward every sink
        # A channel that failed to connect fails calls fast until its reconnect backoff ends (1 s growing
        # to 120 s by default): keep it within our retries, and within a quarter of one push's bound
        # (``push_bound_s``, --sink-timeout-s), so that a sink back from a restart is reached by the next
        # push (seen: a 2 s backoff outlasting a 1 s bound, every push UNAVAILABLE after the sink was up).
        # gRPC's "min reconnect backoff" is the least time a connection attempt is given (its connect
        # deadline): 1 s, so that short attempts do not time out on a loaded host.
        backoff_max_s = sink_backoff_max_s(push_bound_s)
        self._options = [("grpc.max_send_message_length", max_message_bytes),
                         ("grpc.max_receive_message_length", max_message_bytes),
                         ("grpc.initial_reconnect_backoff_ms", 100),
                         ("grpc.min_reconnect_backoff_ms", 1000),
                         ("grpc.max_reconnect_backoff_ms", max(100, int(backoff_max_s * 1000)))]
        self._idle_close_s = idle_close_s
        self._max_channels = max_channels
        # target -> [channel, pushes using it, last time one ended]
        self._channels: dict[str, list] = {}
        self._closing: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._channels)

    def acquire(self, target: str) -> grpc.aio.Channel:
        """The channel to target, held until ``release(target)``."""
        self._prune(time.monotonic())
        slot = self._channels.get(target)
        if slot is None:
            channel = (grpc.aio.secure_channel(target, self._credentials, options=self._options)
                       if self._credentials is not None
                       else grpc.aio.insecure_channel(target, options=self._options))
            slot = self._channels[target] = [channel, 0, time.monotonic()]
        slot[1] += 1
        return slot[0]

    def release(self, target: str) -> None:
        slot = self._channels.get(target)
        if slot is not None:
            slot[1] -= 1
            slot[2] = time.monotonic()

    def _prune(self, now: float) -> None:
        idle = sorted((slot[2], target) for target, slot in self._channels.items() if slot[1] == 0)
        over = len(self._channels) + 1 - self._max_channels
        for n, (last_used, target) in enumerate(idle):
            if n >= over and now - last_used < self._idle_close_s:
                break
            self._close(self._channels.pop(target)[0])

    def _close(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        channels, self._channels = [slot[0] for slot in self._channels.values()], {}
        for channel in channels:
            await channel.close()
        if self._closing:
            await asyncio.wait(set(self._closing))


def header_chunk(last: encoder_pb2.EmbeddingChunk, request_id: str) -> encoder_pb2.EmbeddingChunk:
    """What the caller's stream gets for a pushed image: its last chunk without data, from row 0."""
    header = encoder_pb2.EmbeddingChunk()
    header.CopyFrom(last)
    header.request_id = request_id
    header.ClearField("data")
    header.ClearField("num_images")
    header.token_offset = 0
    header.last = True
    return header


class SinkPush:
    """One request's Push stream to one sink; ``push`` each image's chunks, then ``finish``.

    Retries UNAVAILABLE until ``timeout_s`` (from construction) has passed; any other outcome than
    the sink's ack of every image raises SinkFailed, whose reason the caller logs and counts.
    """

    def __init__(self, spec: SinkSpec, channel: grpc.aio.Channel, num_images: int, *, timeout_s: float,
                 backoff_base_s: float = SINK_BACKOFF_BASE_S, backoff_max_s: float | None = None) -> None:
        self.spec = spec
        self.num_images = num_images
        self._stub = encoder_pb2_grpc.EmbeddingSinkStub(channel)
        self._deadline = time.monotonic() + timeout_s
        # By default as close together as the channel's reconnects (``sink_backoff_max_s``): a 2 s wait
        # between tries left a sink back at 0.5 s unreached within a 2 s bound (CI).
        self._backoff = (backoff_base_s, sink_backoff_max_s(timeout_s) if backoff_max_s is None else backoff_max_s)
        self._sent: list[encoder_pb2.EmbeddingChunk] = []
        self._call: grpc.aio.StreamUnaryCall | None = None
        self._attempt = 0
        self._done = False

    async def push(self, chunks: Sequence[encoder_pb2.EmbeddingChunk]) -> None:
        for chunk in chunks:
            chunk.request_id = self.spec.request_id
            chunk.num_images = self.num_images
        self._sent.extend(chunks)
        while True:
            try:
                if self._call is None:
                    await self._open_and_replay()
                else:
                    for chunk in chunks:
                        await self._call.write(chunk)
                return
            except _CALL_ERRORS as exc:
                await self._after_failure(exc)

    async def finish(self) -> int:
        """Ends the stream and waits for the sink's ack; returns the images it acknowledged."""
        while True:
            try:
                if self._call is None:
                    await self._open_and_replay()
                await self._call.done_writing()
                ack = await self._call
                break
            except _CALL_ERRORS as exc:
                await self._after_failure(exc)
        self._done = True
        if ack.images != self.num_images:
            raise SinkFailed("bad_ack", f"acknowledged {ack.images} of {self.num_images} images")
        return ack.images

    def cancel(self) -> None:
        """Stops the stream (the request failed or was cancelled): the sink sees it cancelled."""
        if self._call is not None and not self._done:
            self._call.cancel()
        self._call = None

    def _remaining_s(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    async def _open_and_replay(self) -> None:
        if self._remaining_s() <= 0:
            raise SinkFailed("deadline", "the push did not finish within --sink-timeout-s")
        self._call = self._stub.Push(timeout=self._remaining_s(), wait_for_ready=False)
        for chunk in self._sent:
            await self._call.write(chunk)

    async def _after_failure(self, exc: BaseException) -> None:
        call, self._call = self._call, None
        code, details = await _status(call, exc)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise SinkFailed("deadline", f"the push did not finish in time: {details}") from None
        if code != grpc.StatusCode.UNAVAILABLE:
            raise SinkFailed("refused", f"{code.name}: {details}") from None
        delay = min(self._backoff[1], self._backoff[0] * 2 ** self._attempt) * random.uniform(0.5, 1.0)
        if self._remaining_s() <= delay:
            raise SinkFailed("unavailable", f"unavailable after {self._attempt + 1} attempts: {details}") from None
        self._attempt += 1
        log.debug("sink %s unavailable (%s); push attempt %d in %.2f s", self.spec.target, details,
                  self._attempt + 1, delay)
        await asyncio.sleep(delay)


async def _status(call: grpc.aio.StreamUnaryCall | None, exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    if call is not None:
        try:
            return await call.code(), (await call.details()) or ""
        except Exception:  # the status is all we want; without one, call it unavailable
            pass
    return grpc.StatusCode.UNAVAILABLE, str(exc)


async def fail_uniformly(spec: SinkSpec, exc: SinkFailed, started: float, bound_s: float,
                         failures: Counter) -> Unavailable:
    """Logs and counts (in ``failures``, encoder_service_sink_push_failures) the real reason, waits
    until ``bound_s`` after ``started``, and returns the one error every sink failure gets (raise it)."""
    log.warning("push to sink %s (pattern %r) failed: %s: %s", spec.target, spec.pattern, exc.reason, exc.message)
    failures.labels(pattern=spec.pattern, reason=exc.reason).inc()
    await asyncio.sleep(max(0.0, started + bound_s - time.monotonic()))
    return Unavailable(f"sink {spec.target} did not take the push within {bound_s:g} s "
                       "(the encoder's log says why)")
