"""The one exception every failed RPC of the client raises."""

from __future__ import annotations

import grpc


class EncoderClientError(Exception):
    """An RPC to the encoder service failed.

    ``code`` is the ``grpc.StatusCode`` and ``details`` the server's message, verbatim (the server
    says which image and why, so the text is worth passing on unchanged). Errors the client
    detects in a response (a malformed stream) use ``StatusCode.INTERNAL``.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> EncoderClientError:
        # Both grpc.Call (sync) and AioRpcError expose code()/details(); a bare RpcError may not.
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        return cls(code if code is not None else grpc.StatusCode.UNKNOWN, details or "")
