"""Backend names -> classes, imported lazily so a missing optional kernel library costs nothing
until that backend is chosen."""

from __future__ import annotations

import importlib

from .base import AttentionBackend

BACKENDS: dict[str, str] = {
    "sdpa": "encoder_service.attention.sdpa:SDPABackend",
    "varlen": "encoder_service.attention.varlen:VarlenBackend",
    "flashinfer": "encoder_service.attention.flashinfer:FlashInferBackend",
    "flashinfer-fa3": "encoder_service.attention.flashinfer:FlashInferRaggedBackend",
    "flashinfer-fa2": "encoder_service.attention.flashinfer:FlashInferFA2Backend",
    "flashinfer-cudnn": "encoder_service.attention.flashinfer:FlashInferCuDNNBackend",
    "aiter": "encoder_service.attention.aiter:AiterBackend",
}


def backend_class(name: str) -> type[AttentionBackend]:
    module_name, _, attr = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module_name), attr)
