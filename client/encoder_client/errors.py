"""The one exception every failed RPC of the client raises."""

from __future__ import annotations

import grpc


class EncoderClientError(Exception):
    """An RPC to the encoder service failed.

    ``code`` is the ``grpc.StatusCode`` and ``details`` the server's message, verbatim (the server
    says which image and why, so the text is worth passing on unchanged). Errors the client
    detects in a response (a malformed stream) use ``StatusCode.INTERNAL``.

    ``retry_pushback_ms`` is the server's ``grpc-retry-pushback-ms`` trailer (gRFC A6), None where
    it sent none. The encoder service sends it with every RESOURCE_EXHAUSTED: >= 0 for a momentary
    limit (a full queue: the same request may pass that much later, or on another replica), -1
    for a request over a limit that no retry can pass (an image with too many patches).
    """

    def __init__(self, code: grpc.StatusCode, details: str, retry_pushback_ms: int | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.retry_pushback_ms = retry_pushback_ms

    @property
    def retry_may_pass(self) -> bool:
        """Whether the same request may succeed if sent again: the server was unavailable, or
        refused it for a momentary limit (RESOURCE_EXHAUSTED with a pushback >= 0)."""
        if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return self.retry_pushback_ms is not None and self.retry_pushback_ms >= 0
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> EncoderClientError:
        # Both grpc.Call (sync) and AioRpcError expose code()/details(); a bare RpcError may not.
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        return cls(code if code is not None else grpc.StatusCode.UNKNOWN, details or "", _pushback_ms(err))


PUSHBACK_KEY = "grpc-retry-pushback-ms"


def _pushback_ms(err: grpc.RpcError) -> int | None:
    """The pushback trailer as an int; -1 for one that does not parse (A6: "do not retry")."""
    try:
        trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    except Exception:  # a call that never got trailers
        return None
    for key, value in trailers or ():
        if key == PUSHBACK_KEY:
            try:
                return int(value)
            except (TypeError, ValueError):
                return -1
    return None
