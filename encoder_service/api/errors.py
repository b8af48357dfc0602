"""Typed errors -> gRPC statuses, in this one place at the API edge.

An ``EncoderError`` becomes its status with its message (which names the image). Anything else is
a bug: logged with its traceback here, answered INTERNAL with a generic message (never the trace).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from .. import metrics
from ..errors import EncoderError

log = logging.getLogger(__name__)

T = TypeVar("T")

INTERNAL_MESSAGE = "internal error in the encoder service (details are in its log)"


def status_code(exc: EncoderError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)


def map_errors(handler: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Decorates an async servicer method ``(self, request, context)``."""

    @functools.wraps(handler)
    async def wrapper(self, request, context: grpc.aio.ServicerContext) -> T:
        try:
            return await handler(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except EncoderError as exc:
            code = status_code(exc)
            metrics.REJECTED.labels(code=code.name).inc()
            log.info("%s %s: %s", handler.__name__, code.name, exc)
            await context.abort(code, str(exc))
        except Exception:
            metrics.REJECTED.labels(code="INTERNAL").inc()
            log.exception("%s failed", handler.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
        raise AssertionError("unreachable: context.abort raises")

    return wrapper
