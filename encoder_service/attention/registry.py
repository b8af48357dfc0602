"""Backend names -> classes, imported lazily so a missing optional kernel library costs nothing
until that backend is chosen."""

from __future__ import annotations

import importlib

from .base import AttentionBackend

BACKENDS: dict[str, str] = {
    "sdpa": "encoder_service.attention.sdpa:SDPABackend",
    "varlen": "encoder_service.attention.varlen:VarlenBackend",
}


def backend_class(name: str) -> type[AttentionBackend]:
    module_name, _, attr = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module_name), attr)
