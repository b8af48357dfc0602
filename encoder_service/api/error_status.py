"""Typed errors -> gRPC statuses: what the server interceptor (api/service_interceptor.py) answers for an error.

An ``EncoderError`` becomes its status with its message (which names the image). Anything else is
a bug: logged with its traceback, answered INTERNAL with a generic message (never the trace).
"""

from __future__ import annotations

import logging

import grpc

from ..errors import EncoderError, ResourceExhausted

log = logging.getLogger(__name__)

# Load shedding, draining and calls without a token come in floods exactly when the server is
# busiest (or probed): counted in encoder_service_requests_total{code}, logged only at DEBUG.
_QUIET_CODES = ("RESOURCE_EXHAUSTED", "UNAVAILABLE", "UNAUTHENTICATED")
INTERNAL_MESSAGE = "internal error in the encoder service (details are in its log)"
# gRFC A6: a client whose retry policy covers the status waits this many milliseconds before its
# retry; a negative value asks it not to retry at all.
PUSHBACK_KEY = "grpc-retry-pushback-ms"


def status_code(exc: EncoderError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)


def to_status(method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message a call of ``method`` that raised ``exc`` ends with; logs it."""
    if isinstance(exc, EncoderError):
        status = status_code(exc)
        log.log(logging.DEBUG if status.name in _QUIET_CODES else logging.INFO, "%s %s: %s", method, status.name, exc)
        return status, str(exc)
    log.error("%s failed", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE


def trailers(exc: Exception) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that goes with ``exc``'s status: for RESOURCE_EXHAUSTED, whether and
    when a retry of the same request can pass (a full queue: after the pushback; an image over a
    limit: never). Proxies turn it into HTTP 503 + Retry-After against 413."""
    if not isinstance(exc, ResourceExhausted):
        return ()
    pushback = -1 if exc.retry_after_s is None else round(exc.retry_after_s * 1000)
    return ((PUSHBACK_KEY, str(pushback)),)
