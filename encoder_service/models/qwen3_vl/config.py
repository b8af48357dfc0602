"""The vision tower's settings, read from a whole checkpoint ``config.json``.

Defaults are those of transformers' ``Qwen3VLVisionConfig`` / ``Qwen3_5VisionConfig`` (and their MoE
twins, which have the same vision fields), so a config.json that omits a key means what it means
to transformers. Qwen3.5's tower has no deepstack mergers: its ``deepstack_visual_indexes`` is
empty whatever the file says (transformers' Qwen3.5 model never reads the key either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from ...errors import InvalidInput
from ..layers import ACTIVATIONS

# model_type -> (vision model_type, whether the tower has deepstack mergers)
MODEL_TYPES: dict[str, tuple[str, bool]] = {
    "qwen3_vl": ("qwen3_vl_vision", True),
    "qwen3_vl_moe": ("qwen3_vl_moe_vision", True),
    "qwen3_5": ("qwen3_5_vision", False),
    "qwen3_5_moe": ("qwen3_5_moe_vision", False),
}
# The packed host metadata carries patch positions and table indices as float32 (metadata.py):
# exact for integers up to 2**24.
MAX_EXACT_FLOAT32_INT = 1 << 24

_POSITIVE_INTS = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                  "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings")
# transformers' attribute_map: either spelling is accepted, the first wins.
_ALIASES = {"depth": ("depth", "num_hidden_layers"), "num_heads": ("num_heads", "num_attention_heads")}


@dataclass(frozen=True)
class Qwen3VLVisionConfig:
    model_type: str = "qwen3_vl"
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_grid_per_side(self) -> int:
        """Side of the learned (square) position table."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size * self.spatial_merge_size

    @property
    def feature_levels(self) -> int:
        """Levels per output row: the main merger's, then one per deepstack merger."""
        return 1 + len(self.deepstack_visual_indexes)

    @classmethod
    def from_config(cls, config: dict) -> Qwen3VLVisionConfig:
        """From a checkpoint's top-level config.json (the tower's part under ``vision_config``)."""
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise InvalidInput(f"model_type {model_type!r} is not a Qwen3-VL / Qwen3.5 type; "
                               f"expected one of {', '.join(MODEL_TYPES)}")
        v = config.get("vision_config")
        if not isinstance(v, dict):
            raise InvalidInput(f"config.json of a {model_type} checkpoint has no vision_config mapping "
                               f"(got {type(v).__name__})")
        kwargs: dict[str, Any] = {"model_type": model_type}
        for name in _POSITIVE_INTS:
            for key in _ALIASES.get(name, (name,)):
                if v.get(key) is not None:
                    kwargs[name] = _positive_int(key, v[key])
                    break
        if v.get("hidden_act") is not None:
            kwargs["hidden_act"] = v["hidden_act"]
        kwargs["rope_theta"] = _rope_theta(v)
        if MODEL_TYPES[model_type][1]:
            if v.get("deepstack_visual_indexes") is not None:
                kwargs["deepstack_visual_indexes"] = _index_list(v["deepstack_visual_indexes"])
        else:
            kwargs["deepstack_visual_indexes"] = ()
        cfg = cls(**kwargs)
        cfg.check()
        return cfg

    def check(self) -> None:
        """Relations between fields that the tower needs; each failure names the key and value."""
        if self.hidden_size % self.num_heads:
            raise InvalidInput(f"vision_config: hidden_size {self.hidden_size} is not divisible by "
                               f"num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise InvalidInput(f"vision_config: hidden_size {self.hidden_size} / num_heads {self.num_heads} gives "
                               f"head_dim {self.head_dim}, not a multiple of 4 (the 2-D rotary embedding "
                               "splits each head in four)")
        side = self.num_grid_per_side
        if side * side != self.num_position_embeddings:
            raise InvalidInput(f"vision_config: num_position_embeddings {self.num_position_embeddings} is not a "
                               "square (the learned position table is a square grid)")
        if self.num_position_embeddings > MAX_EXACT_FLOAT32_INT:
            raise InvalidInput(f"vision_config: num_position_embeddings {self.num_position_embeddings} is over "
                               f"{MAX_EXACT_FLOAT32_INT}")
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACTIVATIONS:
            raise InvalidInput(f"vision_config: hidden_act {self.hidden_act!r} is not supported; supported: "
                               f"{', '.join(ACTIVATIONS)}")
        levels = self.deepstack_visual_indexes
        bad = [i for i in levels if not 0 <= i < self.depth]
        if bad:
            raise InvalidInput(f"vision_config: deepstack_visual_indexes {list(levels)} has {bad}, outside the "
                               f"{self.depth} blocks (depth)")
        # transformers emits the deepstack features in block order, merger j taking the block named at
        # position j: only an increasing list makes both orders the same, which the wire layout needs.
        if any(b <= a for a, b in pairwise(levels)):
            raise InvalidInput(f"vision_config: deepstack_visual_indexes {list(levels)} must be strictly "
                               "increasing")

    def to_dict(self) -> dict:
        """transformers' vision_config field names (fingerprint, and checkpoint configs)."""
        return {
            "depth": self.depth, "hidden_size": self.hidden_size, "hidden_act": self.hidden_act,
            "intermediate_size": self.intermediate_size, "num_heads": self.num_heads,
            "in_channels": self.in_channels, "patch_size": self.patch_size,
            "spatial_merge_size": self.spatial_merge_size, "temporal_patch_size": self.temporal_patch_size,
            "out_hidden_size": self.out_hidden_size, "num_position_embeddings": self.num_position_embeddings,
            "deepstack_visual_indexes": list(self.deepstack_visual_indexes),
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
        }


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInput(f"vision_config: {key} must be a positive integer, got {value!r}")
    return value


def _index_list(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise InvalidInput(f"vision_config: deepstack_visual_indexes must be a list of block indexes, got {value!r}")
    return tuple(value)


def _rope_theta(v: dict) -> float:
    """``rope_parameters.rope_theta``, else the legacy top-level ``rope_theta``, else 10000.

    transformers turns a ``default`` rope type into ``axial`` for these towers (old checkpoints) and
    builds only axial rotary; any other type would fail there.
    """
    rope = v.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise InvalidInput(f"vision_config: rope_parameters must be a mapping, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type not in (None, "default", "axial"):
        raise InvalidInput(f"vision_config: rope_parameters.rope_type {rope_type!r} is not supported; the vision "
                           "tower's rotary is axial")
    theta = rope.get("rope_theta", v.get("rope_theta"))
    if theta is None:
        return Qwen3VLVisionConfig.rope_theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise InvalidInput(f"vision_config: rope_theta must be a positive number, got {theta!r}")
    return float(theta)
