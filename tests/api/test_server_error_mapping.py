"""The service interceptor (api/service_interceptor.py), on a real in-process grpc.aio server: the one place typed
errors become statuses (anything else is INTERNAL without details), requests are counted by method
and code, and the drain's bookkeeping is kept."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry

from encoder_service.api.error_status import INTERNAL_MESSAGE
from encoder_service.api.interceptor_support import refusal
from encoder_service.api.service_interceptor import CallBook, ServiceInterceptor
from encoder_service.errors import InvalidInput, NotFound, PermissionDenied, ResourceExhausted, Unavailable
from encoder_service.metrics import VISION_ENCODER, ServiceMetrics

pytestmark = pytest.mark.timeout(60)

SERVICE = VISION_ENCODER.full_name
LOOKUP = f"/{SERVICE}/Lookup"


@contextlib.asynccontextmanager
async def serving(behaviour, *inner: grpc.aio.ServerInterceptor, calls: CallBook | None = None):
    """A server whose Lookup runs ``behaviour(request_bytes, context)`` behind the service
    interceptor (and ``inner`` interceptors after it), recording into a registry of its own."""
    metrics = ServiceMetrics(CollectorRegistry())
    calls = calls or CallBook()
    server = grpc.aio.server(interceptors=[ServiceInterceptor(metrics, calls), *inner])
    handlers = {"Lookup": grpc.unary_unary_rpc_method_handler(behaviour)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield SimpleNamespace(lookup=channel.unary_unary(LOOKUP), metrics=metrics, calls=calls)
    finally:
        await server.stop(0)


def requests(metrics: ServiceMetrics, code: str, method: str = "Lookup") -> float:
    return metrics.registry.get_sample_value("encoder_service_requests_total", {"method": method, "code": code})


def raising(exc: BaseException):
    async def behaviour(request, context):
        raise exc

    return behaviour


@pytest.mark.parametrize("exc, code, details", [
    (InvalidInput("bad grid", image_index=2), grpc.StatusCode.INVALID_ARGUMENT, "image 2: bad grid"),
    (NotFound("content_hash x is not cached").with_image(0), grpc.StatusCode.NOT_FOUND,
     "image 0: content_hash x is not cached"),
    (ResourceExhausted("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
    (Unavailable("server is draining"), grpc.StatusCode.UNAVAILABLE, "server is draining"),
])
def test_typed_errors_become_their_status_and_are_counted_under_it(exc, code, details):
    async def main():
        async with serving(raising(exc)) as s:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.lookup(b"")
            assert (info.value.code(), info.value.details()) == (code, details)
            assert requests(s.metrics, code.name) == 1 and requests(s.metrics, "OK") == 0
            count = s.metrics.registry.get_sample_value("encoder_service_request_seconds_count", {"method": "Lookup"})
            assert count == 1

    asyncio.run(main())


@pytest.mark.parametrize("exc, pushback", [
    (ResourceExhausted("queue full", retry_after_s=1.0), "1000"),  # momentary: retry a second later
    (ResourceExhausted("image has 5000 patches"), "-1"),  # the request itself is over: never retry
])
def test_a_resource_exhausted_says_in_its_trailers_whether_a_retry_can_pass(exc, pushback):
    async def main():
        async with serving(raising(exc)) as s:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.lookup(b"")
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(info.value.trailing_metadata())["grpc-retry-pushback-ms"] == pushback

    asyncio.run(main())


def test_other_errors_carry_no_retry_pushback():
    async def main():
        async with serving(raising(InvalidInput("bad grid"))) as s:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.lookup(b"")
            assert "grpc-retry-pushback-ms" not in dict(info.value.trailing_metadata() or ())

    asyncio.run(main())


def test_unexpected_errors_are_internal_and_leak_nothing(caplog):
    async def main():
        async with serving(raising(RuntimeError("secret path /opt/model/x.py line 3"))) as s:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.lookup(b"")
            assert info.value.code() == grpc.StatusCode.INTERNAL and info.value.details() == INTERNAL_MESSAGE
            assert requests(s.metrics, "INTERNAL") == 1

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert "secret path" in caplog.text and "Traceback" in caplog.text  # the trace stays server-side


def test_an_answer_is_counted_ok_and_the_requests_in_flight_gauge_returns_to_zero():
    seen = []

    async def main():
        async def answer(request, context):
            seen.append(s.metrics.registry.get_sample_value("encoder_service_requests_in_flight"))
            return b"fine"

        async with serving(answer) as s:
            assert await s.lookup(b"") == b"fine"
            assert requests(s.metrics, "OK") == 1
            assert s.metrics.registry.get_sample_value("encoder_service_requests_in_flight") == 0

    asyncio.run(main())
    assert seen == [1]


def test_calls_in_flight_are_counted_until_they_end_and_not_while_draining():
    seen = []

    async def main():
        calls = CallBook()

        async def probe(request, context):
            seen.append(calls.in_flight)
            if request == b"fail":
                raise InvalidInput("bad")
            return b""

        async with serving(probe, calls=calls) as s:
            await s.lookup(b"")
            with pytest.raises(grpc.aio.AioRpcError):
                await s.lookup(b"fail")
            calls.draining = True
            await s.lookup(b"")
            assert calls.in_flight == 0 and calls.last_started > 0

    asyncio.run(main())
    assert seen == [1, 1, 0]


def test_a_caller_giving_up_is_counted_cancelled_not_an_error():
    async def main():
        entered = asyncio.Event()

        async def slow(request, context):
            entered.set()
            await asyncio.sleep(30)

        async with serving(slow) as s:
            call = s.lookup(b"")
            await entered.wait()
            call.cancel()
            for _ in range(500):  # the server sees the cancel a moment after the client
                if requests(s.metrics, "CANCELLED"):
                    break
                await asyncio.sleep(0.01)
            assert requests(s.metrics, "CANCELLED") == 1 and requests(s.metrics, "INTERNAL") == 0
            assert s.calls.in_flight == 0

    asyncio.run(main())


def test_a_handler_that_aborts_by_itself_is_counted_under_its_code():
    async def aborting(request, context):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not now")

    async def main():
        async with serving(aborting) as s:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.lookup(b"")
            assert (info.value.code(), info.value.details()) == (grpc.StatusCode.FAILED_PRECONDITION, "not now")
            # abort() sends the status before the handler's abort error unwinds through the interceptor,
            # so the client can hold the status a moment before the server counts the call (CI saw 0).
            for _ in range(500):
                if s.calls.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert requests(s.metrics, "FAILED_PRECONDITION") == 1 and s.calls.in_flight == 0

    asyncio.run(main())


class RefuseAll(grpc.aio.ServerInterceptor):
    """An inner interceptor refusing every call, as the token check refuses a wrong token."""

    async def intercept_service(self, continuation, details):
        return refusal(await continuation(details), PermissionDenied("the bearer token is not accepted"))


def test_a_refusal_by_an_inner_interceptor_is_answered_and_counted_once():
    async def main():
        async with serving(raising(AssertionError("the handler must not run")), RefuseAll()) as s:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.lookup(b"")
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert info.value.details() == "the bearer token is not accepted"
            assert requests(s.metrics, "PERMISSION_DENIED") == 1
            assert sum(requests(s.metrics, code.name) for code in grpc.StatusCode) == 1

    asyncio.run(main())


def test_every_method_of_the_service_descriptor_has_its_series_and_other_services_none():
    metrics = ServiceMetrics(CollectorRegistry())
    for method in VISION_ENCODER.methods:
        assert requests(metrics, "OK", method.name) == 0
        assert requests(metrics, "INTERNAL", method.name) == 0
    assert requests(metrics, "OK", "Check") is None
