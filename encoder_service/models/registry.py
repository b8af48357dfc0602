"""The model families, one line each: adding a family is its package plus one line here.

Each entry names a package whose ``FAMILY`` (a ``family.ModelFamily``) lists the checkpoint
``model_type`` values and presets it serves. Packages are imported on first use.
"""

from __future__ import annotations

import importlib
from functools import cache

from ..errors import InvalidInput
from .family import ModelFamily, Preset

FAMILY_PACKAGES: tuple[str, ...] = (
    "encoder_service.models.qwen2_5_vl",
    "encoder_service.models.kimi_k25",
    "encoder_service.models.qwen3_vl",
)


@cache
def families() -> tuple[ModelFamily, ...]:
    return tuple(importlib.import_module(name).FAMILY for name in FAMILY_PACKAGES)


def model_types() -> list[str]:
    return [t for family in families() for t in family.model_types]


def family_for(model_type: str | None) -> ModelFamily:
    for family in families():
        if model_type in family.model_types:
            return family
    raise InvalidInput(f"unsupported model_type {model_type!r}; supported: {', '.join(model_types())}")


@cache
def presets() -> dict[str, Preset]:
    return {p.name: p for family in families() for p in family.presets}


def get_preset(name: str) -> Preset:
    try:
        return presets()[name]
    except KeyError:
        raise InvalidInput(f"unknown preset {name!r}; presets: {', '.join(presets())}") from None
