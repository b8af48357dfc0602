"""What the preprocessors' settings share (``Qwen2VLPreprocessConfig``, models/qwen2_5_vl/preprocess.py;
``KimiK25PreprocessConfig``, models/kimi_k25/preprocess.py): transformers' image-processor keys for the
flags, rescaling and normalisation, their checks, and the fingerprint that goes into the cache key."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from encoder_service.errors import InvalidInput

NUM_CHANNELS = 3


def check_positive_ints(settings: Any, names: Iterable[str]) -> None:
    for name in names:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidInput(f"preprocessor config: {name} must be a positive int, got {value!r}")


def check_normalization(settings: Any) -> None:
    """image_mean and image_std: one value per channel, no zero std."""
    for name in ("image_mean", "image_std"):
        if len(getattr(settings, name)) != NUM_CHANNELS:
            raise InvalidInput(f"preprocessor config: {name} needs {NUM_CHANNELS} values")
    if any(s == 0 for s in settings.image_std):
        raise InvalidInput("preprocessor config: image_std has a zero")


def check_video_fps(settings: Any) -> None:
    """A video processor's default ``fps`` (its frames sampled per second): a positive number."""
    if not settings.fps > 0:
        raise InvalidInput(f"video processor config: fps must be positive, got {settings.fps!r}")


def flag_and_normalization_kwargs(config: Mapping[str, Any], flags: Iterable[str]) -> dict[str, Any]:
    """The given ``do_*`` flags, ``rescale_factor``, ``image_mean`` and ``image_std`` that config sets."""
    kwargs: dict[str, Any] = {}
    for field in flags:
        if config.get(field) is not None:
            kwargs[field] = bool(config[field])
    if config.get("rescale_factor") is not None:
        kwargs["rescale_factor"] = float(config["rescale_factor"])
    for field in ("image_mean", "image_std"):
        value = config.get(field)
        if value is None:
            continue
        # transformers broadcasts a scalar to every channel; store the broadcast form so the
        # fingerprint of equivalent configs is equal.
        values = [value] * NUM_CHANNELS if isinstance(value, (int, float)) else list(value)
        kwargs[field] = tuple(float(v) for v in values)
    return kwargs


def fingerprint(settings: Any) -> dict[str, Any]:
    """Every field of a settings dataclass, JSON-ready; part of the cache key (any change changes the
    patches)."""
    return {f.name: list(v) if isinstance(v := getattr(settings, f.name), tuple) else v
            for f in dataclasses.fields(settings)}


def check_patch_layout(settings: Any, tower: Any, model_id: str, what: str) -> None:
    """A processor's patches must be the tower's (``tower``: a vision config with ``patch_size``,
    ``temporal_patch_size``, ``spatial_merge_size``), else every request would fail later: InvalidInput
    naming the checkpoint, the file's setting and the tower's."""
    for name, tower_name in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                             ("merge_size", "spatial_merge_size")):
        mine, theirs = getattr(settings, name), getattr(tower, tower_name)
        if mine != theirs:
            raise InvalidInput(f"{model_id!r}: the {what} config's {name} {mine} differs from the "
                               f"vision_config's {tower_name} {theirs}")
