"""gRPC edge: servicers (VisionEncoder, health, reflection), request validation, error-to-status
mapping, chunked streaming and the server's life cycle. Knows protobuf; hands plain inputs to the
engine. The relay processes (``relay/``), the SGLang-compatible front end (``sglang/``) and the
security stack (``security/``) are subpackages of their own.

``serve`` and ``VisionEncoderServicer`` are imported on first use: the relay processes of
``--grpc-processes`` (api/relay/process.py) import modules of this package and must not pay for
torch and the engine, which they never touch.
"""

from __future__ import annotations

import importlib

_LAZY = {"serve": ".server", "VisionEncoderServicer": ".servicer"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
