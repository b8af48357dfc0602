"""Model families keyed by the checkpoint's ``model_type``; imported lazily."""

from __future__ import annotations

import importlib

MODELS: dict[str, str] = {
    "qwen2_5_vl": "encoder_service.models.qwen2_5_vl_loading:load",
    "kimi_k25": "encoder_service.models.kimi_k25_loading:load",
}


def loader_for(model_type: str):
    try:
        target = MODELS[model_type]
    except KeyError:
        from ..errors import InvalidInput

        raise InvalidInput(f"unsupported model_type {model_type!r}; supported: {', '.join(MODELS)}") from None
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)
