"""Reads a transformers-format checkpoint directory, taking only the vision tower's tensors.

Each safetensors file is memory-mapped and only the tensors under a vision prefix are read, one
by one: the LLM's weights (most of the bytes) are never copied into memory. With an index file,
shards that hold no vision tensor are not even opened.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import InvalidInput

INDEX_FILE = "model.safetensors.index.json"


@dataclass
class CheckpointFiles:
    root: Path
    config: dict
    preprocessor_config: dict | None  # the image processor's settings (processor_configs)
    # tensor name -> file that holds it
    weight_map: dict[str, Path] = field(default_factory=dict)
    video_processor_config: dict | None = None  # the video processor's settings (processor_configs)


def _json_object(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise InvalidInput(f"checkpoint file {path.name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"checkpoint file {path.name} holds a JSON {type(value).__name__}, not an object")
    return value


class FromImageFile(dict):
    """Video processor settings that are the checkpoint's ``preprocessor_config.json``: it has no video
    settings of its own (what transformers' video processors then read)."""


def processor_configs(root: Path) -> tuple[dict | None, dict | None]:
    """(image processor settings, video processor settings) of a checkpoint, found where transformers'
    ``from_pretrained`` finds them (5.x): the image processor's in ``processor_config.json``'s
    ``image_processor``, else ``preprocessor_config.json``; the video processor's in
    ``processor_config.json``'s ``video_processor``, else ``video_preprocessor_config.json``, else
    ``preprocessor_config.json`` (a checkpoint without video settings gives its video processor the
    image processor's file). None where the checkpoint has none of them."""
    nested = _json_object(root / "processor_config.json") or {}
    legacy_image = _json_object(root / "preprocessor_config.json")
    image, video = nested.get("image_processor"), nested.get("video_processor")
    for name, value in (("image_processor", image), ("video_processor", video)):
        if value is not None and not isinstance(value, dict):
            raise InvalidInput(f"checkpoint file processor_config.json: {name} is not an object")
    if image is None:
        image = legacy_image
    if video is None:
        video = _json_object(root / "video_preprocessor_config.json")
    if video is None and legacy_image is not None:
        video = FromImageFile(legacy_image)
    return image, video


def read_config(path: str | Path) -> dict:
    """The checkpoint's ``config.json``, read before anything else: the caller picks the family from
    its ``model_type`` (an unsupported model is the more useful error than anything about its weight
    files), then reads the rest with ``read_checkpoint``."""
    root = Path(path)
    if not root.is_dir():
        raise InvalidInput(f"checkpoint {str(root)!r} is not a directory")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise InvalidInput(f"checkpoint {str(root)!r} has no config.json")
    return json.loads(config_file.read_text())


def read_checkpoint(path: str | Path, config: dict) -> CheckpointFiles:
    """The checkpoint at ``path`` whose ``config.json`` ``read_config`` gave: its image and video processor
    settings (``processor_configs``) and where each tensor lives (safetensors headers only)."""
    root = Path(path)
    preprocessor, video = processor_configs(root)

    index = root / INDEX_FILE
    weight_map: dict[str, Path] = {}
    if index.is_file():
        for name, fname in json.loads(index.read_text())["weight_map"].items():
            weight_map[name] = root / fname
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise InvalidInput(f"checkpoint {str(root)!r} has no *.safetensors files")
        for f in files:
            with safe_open(f, framework="pt") as handle:  # reads the header only
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    weight_map[name] = f
    return CheckpointFiles(root, config, preprocessor, weight_map, video)


def vision_prefix(names: Sequence[str], prefixes: Sequence[str]) -> str:
    """The first prefix under which the checkpoint stores tensors."""
    for prefix in prefixes:
        if any(n.startswith(prefix) for n in names):
            return prefix
    raise InvalidInput(f"checkpoint holds no vision tensors (looked for prefixes {list(prefixes)})")


def load_tensors(ckpt: CheckpointFiles, prefixes: Sequence[str], dtype: torch.dtype
                 ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Tensors under the first matching prefix (prefix stripped), and the full names read."""
    prefix = vision_prefix(list(ckpt.weight_map), prefixes)
    by_file: dict[Path, list[str]] = {}
    for name, f in ckpt.weight_map.items():
        if name.startswith(prefix):
            by_file.setdefault(f, []).append(name)
    state: dict[str, torch.Tensor] = {}
    read: list[str] = []
    for f, names in by_file.items():
        with safe_open(f, framework="pt") as handle:
            for name in names:
                state[name[len(prefix):]] = handle.get_tensor(name).to(dtype)
                read.append(name)
    return state, read


def check_state(module: torch.nn.Module, state: dict[str, torch.Tensor], model_id: str) -> None:
    """The checkpoint's tensors are exactly the module's, with the shapes its config implies."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise InvalidInput(f"checkpoint {model_id!r} lacks vision tensors: {', '.join(missing[:8])}"
                           + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise InvalidInput(f"checkpoint {model_id!r} has vision tensors this model does not know: "
                           f"{', '.join(unexpected[:8])}")
    for name, tensor in expected.items():
        if state[name].shape != tensor.shape:
            raise InvalidInput(f"tensor {name} of {model_id!r} has shape {tuple(state[name].shape)}, "
                               f"config implies {tuple(tensor.shape)}")
