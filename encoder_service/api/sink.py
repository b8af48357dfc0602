"""Pushing a request's embeddings to an EmbeddingSink (a prefill/decode server), with retries.

One ``Push`` stream per request: every image's chunks, tagged with the sink's request_id and the
request's ``num_images``, then the end of the stream; the sink's ``PushAck`` says how many images
it holds. On UNAVAILABLE (the sink restarting, a connection reset) the stream is opened again after
a backoff and everything pushed so far is sent again (the receiver starts that request over), so
the pushed chunks stay in memory until the ack: one request's embeddings, which the cache holds
anyway. A sink that stays down fails only the request that named it, with UNAVAILABLE and the
sink's address; any other error of the sink fails the request at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence

import grpc
from encoder_client._proto.encoder.v1 import encoder_pb2, encoder_pb2_grpc

from .. import metrics
from ..errors import EncoderError, ResourceExhausted, Unavailable
from .validation import SinkSpec

log = logging.getLogger(__name__)

SINK_RETRIES = 5
SINK_BACKOFF_BASE_S = 0.1
SINK_BACKOFF_MAX_S = 2.0
# A decode server's gRPC receive limit is 4 MiB unless it raised it: a pushed chunk (data plus
# header) stays under that whatever --max-chunk-bytes says.
PUSH_MAX_CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024


class SinkRefused(EncoderError):
    """The sink answered the push with an error other than UNAVAILABLE (bad data, a bug there)."""

    code = "FAILED_PRECONDITION"


class SinkChannels:
    """One grpc.aio channel per sink target, shared by every request pushing there."""

    def __init__(self, max_message_bytes: int, credentials: grpc.ChannelCredentials | None = None) -> None:
        self._credentials = credentials  # None: plaintext; else TLS (or mTLS) toward every sink
        self._options = [("grpc.max_send_message_length", max_message_bytes),
                         ("grpc.max_receive_message_length", max_message_bytes),
                         # A channel that failed to connect fails calls fast until its reconnect
                         # backoff ends (1 s growing to 120 s by default): keep it within our retries.
                         ("grpc.initial_reconnect_backoff_ms", 100),
                         ("grpc.min_reconnect_backoff_ms", 100),
                         ("grpc.max_reconnect_backoff_ms", int(SINK_BACKOFF_MAX_S * 1000))]
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, target: str) -> grpc.aio.Channel:
        channel = self._channels.get(target)
        if channel is None:
            channel = (grpc.aio.secure_channel(target, self._credentials, options=self._options)
                       if self._credentials is not None
                       else grpc.aio.insecure_channel(target, options=self._options))
            self._channels[target] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


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
    """One request's Push stream to one sink; ``push`` each image's chunks, then ``finish``."""

    def __init__(self, spec: SinkSpec, channel: grpc.aio.Channel, num_images: int, *,
                 timeout_s: float | None = None, retries: int = SINK_RETRIES,
                 backoff_base_s: float = SINK_BACKOFF_BASE_S, backoff_max_s: float = SINK_BACKOFF_MAX_S) -> None:
        self.spec = spec
        self.num_images = num_images
        self._stub = encoder_pb2_grpc.EmbeddingSinkStub(channel)
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._retries = retries
        self._backoff = (backoff_base_s, backoff_max_s)
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
            except (grpc.RpcError, asyncio.InvalidStateError) as exc:
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
            except (grpc.RpcError, asyncio.InvalidStateError) as exc:
                await self._after_failure(exc)
        self._done = True
        if ack.images != self.num_images:
            raise SinkRefused(f"sink {self.spec.target} acknowledged {ack.images} of {self.num_images} images")
        return ack.images

    def cancel(self) -> None:
        """Stops the stream (the request failed or was cancelled): the sink sees it cancelled."""
        if self._call is not None and not self._done:
            self._call.cancel()
        self._call = None

    def _remaining_s(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def _open_and_replay(self) -> None:
        self._call = self._stub.Push(timeout=self._remaining_s(), wait_for_ready=False)
        for chunk in self._sent:
            await self._call.write(chunk)

    async def _after_failure(self, exc: BaseException) -> None:
        call, self._call = self._call, None
        code, details = await _status(call, exc)
        target = self.spec.target
        if code != grpc.StatusCode.UNAVAILABLE:
            metrics.SINK_PUSH_FAILURES.labels(target=target).inc()
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise ResourceExhausted(f"sink {target} refused the push: {details}") from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise Unavailable(f"sink {target}: push did not finish before the deadline") from None
            raise SinkRefused(f"sink {target} refused the push: {code.name}: {details}") from None
        delay = min(self._backoff[1], self._backoff[0] * 2 ** self._attempt) * random.uniform(0.5, 1.0)
        remaining = self._remaining_s()
        if self._attempt >= self._retries or (remaining is not None and remaining <= delay):
            metrics.SINK_PUSH_FAILURES.labels(target=target).inc()
            raise Unavailable(f"sink {target} is unavailable after {self._attempt + 1} attempts: "
                              f"{details}") from None
        self._attempt += 1
        log.info("sink %s unavailable (%s); push attempt %d in %.2f s", target, details, self._attempt + 1, delay)
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
