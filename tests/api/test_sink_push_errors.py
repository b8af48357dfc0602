"""SinkPush against stand-in calls: whatever step of a push a sink's failure surfaces at (opening,
writing, closing the stream, the ack) and whatever grpc raises for it, the push is retried while its
bound allows and then fails with SinkFailed (UNAVAILABLE to the caller), never an error nothing maps
(INTERNAL)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from encoder_client.protocol import encoder_pb2
from grpc._cython import cygrpc

from encoder_service.api.sink_push import _CALL_ERRORS, SinkFailed, SinkPush
from encoder_service.api.validation import SinkSpec

pytestmark = pytest.mark.timeout(60)


def closing_failed() -> Exception:
    """What grpc.aio's ``done_writing()`` raises when the sink went away at the end of a push."""
    return cygrpc.ExecuteBatchError(
        'Failed "execute_batch": (<grpc._cython.cygrpc.SendCloseFromClientOperation object at 0x7f0000000000>,)')


class StandInCall:
    """A grpc.aio StreamUnaryCall's surface as SinkPush uses it; ``fail`` maps a step ("write",
    "done_writing") to the error it raises."""

    def __init__(self, num_images: int, fail: dict[str, Exception]) -> None:
        self.num_images, self.fail = num_images, fail
        self.written: list[encoder_pb2.EmbeddingChunk] = []
        self.cancelled = False

    async def write(self, chunk) -> None:
        if "write" in self.fail:
            raise self.fail["write"]
        self.written.append(chunk)

    async def done_writing(self) -> None:
        if "done_writing" in self.fail:
            raise self.fail["done_writing"]

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        return encoder_pb2.PushAck(images=self.num_images)

    async def code(self) -> grpc.StatusCode:  # the sink went away: the call ends UNAVAILABLE
        return grpc.StatusCode.UNAVAILABLE

    async def details(self) -> str:
        return "Socket closed"

    def cancel(self) -> None:
        self.cancelled = True


class StandInChannel:
    """Hands out one stand-in call per attempt, failing as ``failures`` says (the last one repeats)."""

    def __init__(self, num_images: int, failures: list[dict[str, Exception]]) -> None:
        self.num_images, self.failures = num_images, failures
        self.calls: list[StandInCall] = []

    def stream_unary(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        def open_call(timeout=None, wait_for_ready=None):
            fail = self.failures[min(len(self.calls), len(self.failures) - 1)]
            self.calls.append(StandInCall(self.num_images, fail))
            return self.calls[-1]

        return open_call


def chunks(index: int) -> list[encoder_pb2.EmbeddingChunk]:
    return [encoder_pb2.EmbeddingChunk(image_index=index, data=b"x" * 8, last=True)]


async def push_two_images(channel: StandInChannel, timeout_s: float = 2.0) -> int:
    push = SinkPush(SinkSpec("127.0.0.1:1", "req"), channel, 2, timeout_s=timeout_s, backoff_base_s=0.01,
                    backoff_max_s=0.02)
    await push.push(chunks(0))
    await push.push(chunks(1))
    return await push.finish()


def test_every_call_error_grpc_raises_is_caught_through_its_public_bases():
    for error in (cygrpc.ExecuteBatchError, cygrpc.InternalError, grpc.aio.UsageError, grpc.aio.AioRpcError,
                  asyncio.InvalidStateError):
        assert issubclass(error, _CALL_ERRORS), error


def test_a_sink_gone_while_the_stream_is_closed_is_retried_and_the_push_completes():
    channel = StandInChannel(2, [{"done_writing": closing_failed()}, {}])
    assert asyncio.run(push_two_images(channel)) == 2
    assert len(channel.calls) == 2
    assert [c.image_index for c in channel.calls[1].written] == [0, 1]  # everything sent again


def test_a_sink_that_stays_gone_at_closing_is_unavailable_within_the_bound():
    channel = StandInChannel(2, [{"done_writing": closing_failed()}])
    with pytest.raises(SinkFailed) as info:
        asyncio.run(push_two_images(channel, timeout_s=0.5))
    # The uniform UNAVAILABLE, never INTERNAL. Its reason (a metric label) is "deadline" where the bound ran
    # out during a retry's backoff, which a loaded host makes likely with a 0.5 s bound (seen in CI).
    assert info.value.code == "UNAVAILABLE" and info.value.reason in ("unavailable", "deadline")
    assert len(channel.calls) > 1


def test_a_batch_error_while_writing_is_retried_too():
    channel = StandInChannel(2, [{"write": cygrpc.ExecuteBatchError("Failed \"execute_batch\"")}, {}])
    assert asyncio.run(push_two_images(channel)) == 2
    assert [c.image_index for c in channel.calls[-1].written] == [0, 1]
