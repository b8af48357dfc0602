"""The model-family contract: what one family of vision towers supplies, and the generic code that
loads, builds and writes checkpoints for any family through it.

A family is one package under ``models/`` (``qwen2_5_vl/``, ``kimi_k25/``, ...) whose ``FAMILY``
object subclasses ``ModelFamily``, plus one line in ``registry.py``. It supplies:

- ``model_types``: the checkpoint ``config.json`` ``model_type`` values it reads;
- ``presets``: built-in random-weight models (tiny ones for tests, full-size ones for benchmarks);
- ``parse_config``: a checkpoint's ``config.json`` -> the family's typed config;
- ``new_tower``: the runtime ``nn.Module`` (its state dict is the *runtime layout*; random weights
  and the strict tensor check are derived from it);
- ``read_weights`` / ``to_checkpoint``: checkpoint layout <-> runtime layout;
- ``build``: runtime weights -> a ``VisionModel`` (preprocessing, metadata, attention backend and
  the output description, ``ModelSpec``, live on that model);
- ``checkpoint_config``: a preset's ``config.json``.

Nothing outside the family's package branches on its ``model_type``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import InvalidInput
from .base import VisionModel
from .loader import CheckpointFiles, load_tensors


@dataclass(frozen=True)
class Preset:
    """A built-in model: a family's vision config and preprocessing, with random weights."""

    name: str
    model_type: str
    vision_config: dict
    preprocessor_config: dict
    text_hidden_size: int
    # The video processor's settings where the family keeps them apart from the image processor's
    # (written as video_preprocessor_config.json); None: clips take what the image file gives them.
    video_processor_config: dict | None = None


class ModelFamily:
    """One family of vision towers (see the module docstring). Subclasses set the class attributes
    and implement the methods that raise ``NotImplementedError``."""

    model_types: tuple[str, ...] = ()
    presets: tuple[Preset, ...] = ()
    # Checkpoint layouts ``to_checkpoint`` can write; the first is make-checkpoint's default.
    layouts: tuple[str, ...] = ("transformers",)
    # Where a checkpoint keeps the tower's tensors, tried in order (the first that holds any wins).
    vision_prefixes: tuple[str, ...] = ()

    def parse_config(self, config: dict):
        """A checkpoint's whole ``config.json`` -> the family's config (InvalidInput naming what is wrong)."""
        raise NotImplementedError

    def checkpoint_config(self, preset: Preset) -> dict:
        """The transformers-format ``config.json`` of a preset."""
        raise NotImplementedError

    def new_tower(self, cfg) -> torch.nn.Module:
        """The runtime module, built under whatever device context the caller set (``meta`` for shapes)."""
        raise NotImplementedError

    def build(self, cfg, state: dict[str, torch.Tensor], *, model_id: str, preprocess_config: dict | None,
              device: torch.device, dtype: torch.dtype, attn_backend: str, ops: str = "auto",
              video_config: dict | None = None) -> VisionModel:
        """Runtime-layout weights -> a loaded model on ``device`` (``ops``: ``--ops``, encoder_service/ops).
        ``video_config``: a checkpoint's video processor settings (``loader.processor_configs``), or a
        preset's ``video_processor_config``; None for a preset without one, whose clips take the family's
        defaults."""
        raise NotImplementedError

    def read_weights(self, ckpt: CheckpointFiles, cfg, dtype: torch.dtype
                     ) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The checkpoint's tower tensors in the runtime layout, and the full names read. The default
        strips the first matching ``vision_prefixes`` entry: for families whose runtime names are
        the checkpoint's."""
        return load_tensors(ckpt, self.vision_prefixes, dtype)

    def to_checkpoint(self, state: dict[str, torch.Tensor], cfg, layout: str) -> dict[str, torch.Tensor]:
        """Runtime-layout weights -> full checkpoint names in ``layout`` (one of ``layouts``)."""
        raise NotImplementedError

    def init_weight(self, name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
        """A random weight for ``random_state``. Matrices get 1/sqrt(fan_in): with tiny weights
        attention would be uniform and a wrong rotary or token order could not show in a parity
        test. Norm scales stay near 1, other vectors small."""
        t = torch.randn(shape, generator=gen)
        if len(shape) >= 2:
            return t * shape[1:].numel() ** -0.5
        if self.is_norm_weight(name):
            return 1.0 + 0.1 * t
        return t * 0.1

    def is_norm_weight(self, name: str) -> bool:
        return "norm" in name and name.endswith(".weight")


def random_state(family: ModelFamily, cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights (float32, CPU) in the family's runtime layout."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in family.new_tower(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    return {name: family.init_weight(name, shapes[name], gen) for name in sorted(shapes)}


def preset_config(family: ModelFamily, preset: Preset):
    return family.parse_config(family.checkpoint_config(preset))


def load_preset(family: ModelFamily, preset: Preset, *, seed: int, device: torch.device, dtype: torch.dtype,
                attn_backend: str, ops: str = "auto") -> VisionModel:
    cfg = preset_config(family, preset)
    state = {k: v.to(dtype) for k, v in random_state(family, cfg, seed).items()}
    return family.build(cfg, state, model_id=f"{preset.name}@seed{seed}",
                        preprocess_config=preset.preprocessor_config, device=device, dtype=dtype,
                        attn_backend=attn_backend, ops=ops, video_config=preset.video_processor_config)


def load_checkpoint(family: ModelFamily, ckpt: CheckpointFiles, *, model_id: str, device: torch.device,
                    dtype: torch.dtype, attn_backend: str, ops: str = "auto") -> VisionModel:
    cfg = family.parse_config(ckpt.config)
    state, read = family.read_weights(ckpt, cfg, dtype)
    model = family.build(cfg, state, model_id=model_id, preprocess_config=ckpt.preprocessor_config,
                         device=device, dtype=dtype, attn_backend=attn_backend, ops=ops,
                         video_config=ckpt.video_processor_config)
    model.tensors_read = read
    return model


def write_checkpoint(family: ModelFamily, preset: Preset, out: Path, *, seed: int, layout: str | None) -> Path:
    """config.json, preprocessor_config.json (and video_preprocessor_config.json where the preset has
    video settings of its own) and model.safetensors of a preset with random weights."""
    layout = layout or family.layouts[0]
    if layout not in family.layouts:
        raise InvalidInput(f"unknown checkpoint layout {layout!r} for {preset.name}; "
                           f"layouts: {', '.join(family.layouts)}")
    config = family.checkpoint_config(preset)
    cfg = family.parse_config(config)
    state = family.to_checkpoint(random_state(family, cfg, seed), cfg, layout)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**config, "_preset": preset.name, "_seed": seed}, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(preset.preprocessor_config, indent=2))
    if preset.video_processor_config is not None:
        (out / "video_preprocessor_config.json").write_text(json.dumps(preset.video_processor_config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def prefixed(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in state.items()}
