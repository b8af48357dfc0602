"""The one place typed errors become statuses; anything else is INTERNAL without details."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from encoder_service.api.errors import INTERNAL_MESSAGE, map_errors
from encoder_service.errors import InvalidInput, NotFound, ResourceExhausted, Unavailable


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted


class Handler:
    """What map_errors needs of a servicer: ``draining`` and a ``calls_in_flight`` count."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.draining = False
        self.calls_in_flight = 0

    @map_errors
    async def Call(self, request, context):
        raise self.exc


@pytest.mark.parametrize("exc, code, details", [
    (InvalidInput("bad grid", image_index=2), grpc.StatusCode.INVALID_ARGUMENT, "image 2: bad grid"),
    (NotFound("content_hash x is not cached").with_image(0), grpc.StatusCode.NOT_FOUND,
     "image 0: content_hash x is not cached"),
    (ResourceExhausted("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
    (Unavailable("server is draining"), grpc.StatusCode.UNAVAILABLE, "server is draining"),
])
def test_typed_errors_become_their_status(exc, code, details):
    context = FakeContext()
    with pytest.raises(Aborted):
        asyncio.run(Handler(exc).Call(None, context))
    assert (context.code, context.details) == (code, details)


def test_unexpected_errors_are_internal_and_leak_nothing(caplog):
    context = FakeContext()
    with caplog.at_level(logging.ERROR), pytest.raises(Aborted):
        asyncio.run(Handler(RuntimeError("secret path /opt/model/x.py line 3")).Call(None, context))
    assert context.code == grpc.StatusCode.INTERNAL and context.details == INTERNAL_MESSAGE
    assert "secret" not in context.details
    assert "secret path" in caplog.text and "Traceback" in caplog.text  # the trace stays server-side


def test_calls_in_flight_are_counted_until_they_end_and_not_while_draining():
    handler = Handler(InvalidInput("bad"))
    seen = []

    class Probe(Handler):
        @map_errors
        async def Call(self, request, context):
            seen.append(self.calls_in_flight)

    probe = Probe(None)
    asyncio.run(probe.Call(None, FakeContext()))
    probe.draining = True
    asyncio.run(probe.Call(None, FakeContext()))
    assert seen == [1, 0] and probe.calls_in_flight == 0
    with pytest.raises(Aborted):
        asyncio.run(handler.Call(None, FakeContext()))
    assert handler.calls_in_flight == 0


def test_cancellation_is_not_an_error():
    context = FakeContext()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(Handler(asyncio.CancelledError()).Call(None, context))
    assert context.code is None
