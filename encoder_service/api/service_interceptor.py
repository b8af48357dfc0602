"""One server interceptor around every call of the VisionEncoder service.

It is the first interceptor of the server, so it sees each call's whole life, refusals by the
security interceptors included, and does in one place what each handler would otherwise repeat:

- errors become statuses (api/error_status.py): a servicer method, or an interceptor refusing a call,
  just raises a typed ``EncoderError``;
- the request metrics: ``encoder_service_requests_total{method, code}``, ``_request_seconds``,
  ``_requests_in_flight``;
- the drain's bookkeeping (``CallBook``): the calls still running that began before the drain,
  and when the last call began.

The methods are those of the service's generated descriptor, so a method added to the proto is
covered without a list kept by hand; health and reflection calls pass untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from ..metrics import VISION_ENCODER, ServiceMetrics
from .error_status import to_status, trailers
from .interceptor_support import method_path, wrap_behaviour


@dataclass
class CallBook:
    """What the drain (api/server.py) and the engine gate (api/engine_gate.py) know of the calls in
    progress; only the event loop's thread touches it."""

    draining: bool = False  # set on SIGTERM: the front ends answer new calls UNAVAILABLE
    in_flight: int = 0  # calls that began before the drain and have not ended
    last_started: float = 0.0  # time.monotonic() at the start of the latest call


def _aborted_code(context: grpc.aio.ServicerContext) -> str:
    """The status of a call that ended by ``context.abort`` (a handler that aborts by itself)."""
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: ServiceMetrics, calls: CallBook, service: ServiceDescriptor = VISION_ENCODER,
                 label_prefix: str = "") -> None:
        self.metrics = metrics
        self.calls = calls
        # path -> the `method` label (another service's methods are told apart by a prefix)
        self._methods = {method_path(m): label_prefix + m.name for m in service.methods}

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        method = self._methods.get(details.method)
        if handler is None or method is None:
            return handler
        return wrap_behaviour(handler, functools.partial(self._call, method))

    @contextlib.asynccontextmanager
    async def _call(self, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        m, calls = self.metrics, self.calls
        started = time.perf_counter()
        code = "UNKNOWN"
        m.requests_in_flight.inc()
        calls.last_started = time.monotonic()  # the drain waits for a quiet moment
        counted = not calls.draining  # the drain waits for the calls that began before it
        if counted:
            calls.in_flight += 1
        recorded = False

        def record(code: str) -> None:
            nonlocal recorded
            recorded = True
            if counted:
                calls.in_flight -= 1
            m.requests_in_flight.dec()
            m.requests.labels(method=method, code=code).inc()
            m.request_seconds.labels(method=method).observe(time.perf_counter() - started)

        try:
            yield
            code = "OK"
        except asyncio.CancelledError:
            code = "CANCELLED"  # the caller went away or its deadline passed
            raise
        except grpc.aio.AbortError:
            code = _aborted_code(context)
            raise
        except Exception as exc:
            status, message = to_status(method, exc)
            code = status.name
            # Counted before the status goes out (when the handler returns, just after this), since a
            # caller that has seen the status must find the request counted.
            record(code)
            # The status is set and the handler returns, instead of ``context.abort``: abort raises an
            # AbortError whose traceback holds the frames this error passed through (the handler's
            # request, tens of MB of clip frames), and gRPC's handler keeps that AbortError in a
            # reference cycle, so each failed request's bytes stayed until a garbage-collection pass
            # (400 refused clips left 1.8 GB). Swallowed here, the error and its frames go at once.
            context.set_code(status)
            context.set_details(message)
            context.set_trailing_metadata(trailers(exc))
        finally:
            if not recorded:
                record(code)
