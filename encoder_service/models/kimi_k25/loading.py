"""Builds a Kimi-K2.5 vision model from a checkpoint (vision tower + projector only) or from weights.

Two weight layouts exist in the wild; both load into the original one (``kimi_k25.py``):

original (moonshotai/Kimi-K2.5, remote code ``MoonViT3dPretrainedModel`` + ``PatchMergerMLP``;
the same names are the source patterns of transformers' ``conversion_mapping.py`` entry
``"kimi_k25"``)::

    vision_tower.patch_embed.proj.{weight,bias}          Conv2d(3, D, 14, stride 14)
    vision_tower.patch_embed.pos_emb.weight              [pos_emb_height, pos_emb_width, D]
    vision_tower.encoder.blocks.N.norm0 / norm1          LayerNorms before attention / MLP
    vision_tower.encoder.blocks.N.wqkv.{weight,bias}     fused q|k|v, rotary pairs interleaved
    vision_tower.encoder.blocks.N.wo                     attention output
    vision_tower.encoder.blocks.N.mlp.fc0 / fc1          MLP in / out
    vision_tower.encoder.final_layernorm
    mm_projector.pre_norm, mm_projector.proj.0 / proj.2  projector LayerNorm, Linear, (GELU), Linear

transformers (``Kimi_K25Model`` as ``save_pretrained`` writes it without the reverse mapping; the
target patterns of that same conversion entry, under ``model.`` or bare)::

    vision_tower.patch_embed.proj, vision_tower.patch_embed.pos_emb.position_embeddings
    vision_tower.layers.N.norm1 / norm2, .attn.{q_proj,k_proj,v_proj,proj}, .mlp.fc1 / fc2
    vision_tower.final_layernorm
    mm_projector.pre_norm, mm_projector.in_proj / out_proj

transformers' ``WeightConverter(wqkv -> q/k/v, [Chunk(dim=0), PermuteForRope(...)])`` also moves each
head's q/k rows from interleaved pairs (2i, 2i+1) to rotate-half order (i, i + head_dim/2); loading
that layout undoes the permutation so a single rotary implementation serves both.
"""

from __future__ import annotations

import re

import torch

from ...errors import InvalidInput
from ..loader import CheckpointFiles, check_state, load_tensors
from .model import KimiK25VisionConfig, KimiK25VisionModel, KimiK25VisionTower, time_sincos_table

# Each prefix group is tried in order; the first under which the checkpoint stores tensors wins.
VISION_PREFIXES = ("model.vision_tower.", "vision_tower.")
PROJECTOR_PREFIXES = ("model.mm_projector.", "mm_projector.")

# (transformers name, original name) beginnings, after the vision_tower. / mm_projector. prefix;
# {i} stands for a block index. Read left to right to load, right to left to write.
_VISION_NAMES = [
    ("patch_embed.pos_emb.position_embeddings", "patch_embed.pos_emb.weight"),
    ("layers.{i}.norm1.", "encoder.blocks.{i}.norm0."),
    ("layers.{i}.norm2.", "encoder.blocks.{i}.norm1."),
    ("layers.{i}.attn.proj.", "encoder.blocks.{i}.wo."),
    ("layers.{i}.mlp.fc1.", "encoder.blocks.{i}.mlp.fc0."),
    ("layers.{i}.mlp.fc2.", "encoder.blocks.{i}.mlp.fc1."),
    ("final_layernorm.", "encoder.final_layernorm."),
]
_PROJECTOR_NAMES = [("in_proj.", "proj.0."), ("out_proj.", "proj.2.")]


def _rename(name: str, pairs: list[tuple[str, str]], to_original: bool) -> str:
    """name with its beginning swapped by the first pair it starts with (unchanged if none)."""
    for split, original in pairs:
        src, dst = (split, original) if to_original else (original, split)
        m = re.match(re.escape(src).replace(r"\{i\}", r"(?P<i>\d+)"), name)
        if m:
            return dst.format(**m.groupdict()) + name[m.end():]
    return name


def rope_rows_to_rotate_half(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Per head, rows (2i, 2i+1) -> (i, i + half): transformers' ``PermuteForRope`` (inverse=False)."""
    rows = t.shape[0]
    return t.reshape(num_heads, rows // num_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def rope_rows_to_interleaved(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of ``rope_rows_to_rotate_half``: ``PermuteForRope(inverse=True)``."""
    rows = t.shape[0]
    return t.reshape(num_heads, 2, rows // num_heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def is_split_layout(names: list[str]) -> bool:
    return any(".q_proj." in n for n in names)


def split_to_original(vision: dict[str, torch.Tensor], projector: dict[str, torch.Tensor],
                      cfg: KimiK25VisionConfig) -> dict[str, torch.Tensor]:
    """transformers' layout (prefix-free groups) -> the module's state dict."""
    state: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in vision.items():
        m = re.match(r"^layers\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)$", name)
        if m:
            i, which, kind = m.groups()
            if which in "qk":
                tensor = rope_rows_to_interleaved(tensor, cfg.num_heads)
            qkv.setdefault(f"vision_tower.encoder.blocks.{i}.wqkv.{kind}", {})[which] = tensor
            continue
        state["vision_tower." + _rename(name, _VISION_NAMES, to_original=True)] = tensor
    for name, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise InvalidInput(f"checkpoint has {sorted(parts)} of q_proj/k_proj/v_proj for {name}, needs all three")
        state[name] = torch.cat([parts["q"], parts["k"], parts["v"]])
    for name, tensor in projector.items():
        state["mm_projector." + _rename(name, _PROJECTOR_NAMES, to_original=True)] = tensor
    return state


def original_to_split(state: dict[str, torch.Tensor], cfg: KimiK25VisionConfig,
                      prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The module's state dict -> transformers' layout (what ``from_pretrained`` holds after its
    conversion). Used to write test checkpoints and to load transformers' reference in parity tests."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        m = re.match(r"^vision_tower\.encoder\.blocks\.(\d+)\.wqkv\.(weight|bias)$", name)
        if m:
            i, kind = m.groups()
            q, k, v = tensor.chunk(3)
            for which, part in (("q", rope_rows_to_rotate_half(q, cfg.num_heads)),
                                ("k", rope_rows_to_rotate_half(k, cfg.num_heads)), ("v", v)):
                out[f"{prefix}vision_tower.layers.{i}.attn.{which}_proj.{kind}"] = part.contiguous()
            continue
        for group, pairs in (("vision_tower.", _VISION_NAMES), ("mm_projector.", _PROJECTOR_NAMES)):
            if name.startswith(group):
                name = group + _rename(name.removeprefix(group), pairs, to_original=False)
                break
        out[prefix + name] = tensor
    return out


def read_weights(ckpt: CheckpointFiles, cfg: KimiK25VisionConfig, dtype: torch.dtype
                 ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tower's and projector's tensors in the original (runtime) layout, whichever layout the
    checkpoint uses, and the full names read."""
    vision, read_v = load_tensors(ckpt, VISION_PREFIXES, dtype)
    projector, read_p = load_tensors(ckpt, PROJECTOR_PREFIXES, dtype)
    if is_split_layout(list(vision)):
        state = split_to_original(vision, projector, cfg)
    else:
        state = {"vision_tower." + k: v for k, v in vision.items()}
        state.update({"mm_projector." + k: v for k, v in projector.items()})
    return state, read_v + read_p


def build(cfg: KimiK25VisionConfig, state: dict[str, torch.Tensor], *, model_id: str,
          preprocess_config: dict | None, device: torch.device, dtype: torch.dtype,
          attn_backend: str, ops: str = "auto", video_config: dict | None = None) -> KimiK25VisionModel:
    """A model from a state dict in the original layout (names as ``KimiK25VisionTower``'s)."""
    with torch.device("meta"):
        module = KimiK25VisionTower(cfg)
    check_state(module, state, model_id)
    module.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    # Non-persistent buffers are not in the state dict: rebuild them for real, in float32 (angles
    # and the frame table are computed at full precision whatever the weights' dtype).
    module.inv_freq = KimiK25VisionTower.rope_inv_freq(cfg)
    module.time_table = time_sincos_table(cfg.hidden_size, cfg.pos_emb_time)
    module = module.to(device=device).eval().requires_grad_(False)
    return KimiK25VisionModel(cfg, module, model_id=model_id, preprocess_config=preprocess_config, device=device,
                              dtype=dtype, attn_backend=attn_backend, ops=ops, video_config=video_config)


def checkpoint_config(vision_config: dict, text_hidden_size: int) -> dict:
    """A transformers-format ``Kimi_K25Config`` dict (vision and projector parts) for a preset."""
    return {
        "model_type": "kimi_k25",
        "architectures": ["Kimi_K25ForConditionalGeneration"],
        "vision_config": {**vision_config, "model_type": "kimi_k25_vision"},
        "text_config": {"model_type": "deepseek_v3", "hidden_size": text_hidden_size},
        "projection_hidden_size": vision_config["hidden_size"],
        "projection_layer_norm_eps": 1e-5,
    }
