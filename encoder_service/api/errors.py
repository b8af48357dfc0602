"""Typed errors -> gRPC statuses, in this one place at the API edge.

An ``EncoderError`` becomes its status with its message (which names the image). Anything else is
a bug: logged with its traceback here, answered INTERNAL with a generic message (never the trace).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from .. import metrics
from ..errors import EncoderError

log = logging.getLogger(__name__)

T = TypeVar("T")

_LOAD_CODES = ("RESOURCE_EXHAUSTED", "UNAVAILABLE")
INTERNAL_MESSAGE = "internal error in the encoder service (details are in its log)"


def status_code(exc: EncoderError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)


def map_errors(handler: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Decorates an async servicer method ``(self, request, context)``; ``self`` counts the calls in
    flight that began before it was ``draining`` in ``calls_in_flight`` and notes when the last call
    began in ``last_call_started``."""

    method = handler.__name__

    @functools.wraps(handler)
    async def wrapper(self, request, context: grpc.aio.ServicerContext) -> T:
        started = time.perf_counter()
        code = "UNKNOWN"
        metrics.REQUESTS_IN_FLIGHT.inc()
        self.last_call_started = time.monotonic()  # the drain waits for a quiet moment
        counted = not self.draining  # the drain waits for the calls that began before it
        if counted:
            self.calls_in_flight += 1
        try:
            result = await handler(self, request, context)
            code = "OK"
            return result
        except asyncio.CancelledError:
            code = "CANCELLED"  # the caller went away or its deadline passed
            raise
        except grpc.aio.AbortError:
            raise
        except EncoderError as exc:
            status = status_code(exc)
            code = status.name
            # Load shedding and draining come in floods exactly when the server is busiest: counted
            # in encoder_service_requests_total{code}, logged only at DEBUG.
            log.log(logging.DEBUG if code in _LOAD_CODES else logging.INFO, "%s %s: %s", method, code, exc)
            await context.abort(status, str(exc))
        except Exception:
            code = "INTERNAL"
            log.exception("%s failed", method)
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
        finally:
            if counted:
                self.calls_in_flight -= 1
            metrics.REQUESTS_IN_FLIGHT.dec()
            metrics.REQUESTS.labels(method=method, code=code).inc()
            metrics.REQUEST_SECONDS.labels(method=method).observe(time.perf_counter() - started)
        raise AssertionError("unreachable: context.abort raises")

    return wrapper
