"""Qwen2.5-VL vision tower: patch embedding, 2-D rotary, window attention with full-attention
blocks, RMSNorm, SwiGLU MLP, patch merger. Batches many images of different sizes in one forward.

Parameter names follow the checkpoints (``patch_embed.proj``, ``blocks.N.attn.qkv``, ...), so a
state dict loads as is after stripping ``visual.`` / ``model.visual.``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...attention import AttentionBackend, fused_window
from ...device import host_to_device
from ...metadata import BatchMetadata, SpatialConfig, build_metadata
from ..base import ModelSpec, VisionModel
from ..layers import RMSNorm, activation, apply_rotary, rms_norm
from ..qwen2_vl_processor import Qwen2VLProcessorHooks
from . import folded

MODEL_TYPE = "qwen2_5_vl"
# Batch compositions kept as CUDA graphs (models/cuda_graphs.py). Off by default: under real traffic
# compositions rarely repeat, and captures cost more than replays save (bench/RESULTS.md).
DEFAULT_GRAPHS = 0


@dataclass(frozen=True)
class Qwen2_5_VisionConfig:
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    out_hidden_size: int = 3584
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, d: dict) -> Qwen2_5_VisionConfig:
        rope = d.get("rope_parameters") or {}
        return cls(
            depth=int(d.get("depth", d.get("num_hidden_layers", cls.depth))),
            hidden_size=int(d.get("hidden_size", cls.hidden_size)),
            intermediate_size=int(d.get("intermediate_size", cls.intermediate_size)),
            num_heads=int(d.get("num_heads", d.get("num_attention_heads", cls.num_heads))),
            in_channels=int(d.get("in_channels", d.get("in_chans", cls.in_channels))),
            out_hidden_size=int(d.get("out_hidden_size", cls.out_hidden_size)),
            patch_size=int(d.get("patch_size", d.get("spatial_patch_size", cls.patch_size))),
            temporal_patch_size=int(d.get("temporal_patch_size", cls.temporal_patch_size)),
            spatial_merge_size=int(d.get("spatial_merge_size", cls.spatial_merge_size)),
            window_size=int(d.get("window_size", cls.window_size)),
            fullatt_block_indexes=tuple(int(i) for i in d.get("fullatt_block_indexes", cls.fullatt_block_indexes)),
            hidden_act=str(d.get("hidden_act", cls.hidden_act)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", cls.rope_theta))),
        )

    def to_dict(self) -> dict:
        return {
            "depth": self.depth, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads, "in_channels": self.in_channels, "in_chans": self.in_channels,
            "out_hidden_size": self.out_hidden_size, "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size, "spatial_merge_size": self.spatial_merge_size,
            "window_size": self.window_size, "fullatt_block_indexes": list(self.fullatt_block_indexes),
            "hidden_act": self.hidden_act, "tokens_per_second": 2,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
        }


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride over each flattened patch is exactly a matrix product."""

    def __init__(self, cfg: Qwen2_5_VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        # Kept Conv3d-shaped so checkpoints load unchanged; applied as one GEMM.
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.view(w.shape[0], -1))


class VisionAttention(nn.Module):
    def __init__(self, cfg: Qwen2_5_VisionConfig) -> None:
        super().__init__()
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)


class MLP(nn.Module):
    def __init__(self, cfg: Qwen2_5_VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)


def pre_attention(x: torch.Tensor, norm_w: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, num_heads: int, eps: float, rotate: bool = True
                  ) -> tuple[torch.Tensor, ...]:
    """RMSNorm, fused QKV projection, rotary: everything of a block before attention.

    ``rotate=False`` stops after the projection and returns ``(qkv,)``, for the fused window kernel
    that applies the rotary itself (attention/fused_window.py)."""
    qkv = F.linear(rms_norm(x, norm_w, eps), qkv_w, qkv_b)
    if not rotate:
        return (qkv,)
    q, k, v = qkv.view(x.shape[0], 3, num_heads, -1).unbind(1)
    q, k = apply_rotary(q, k, cos, sin)
    # Contiguous here, inside the compiled graph, where the copy fuses with the rotary kernel;
    # kernels that want [T, H, D] packed (cuDNN) would otherwise copy it on their own.
    return q, k, v.contiguous()


def between_attentions(x, attn, post_args, pre_args, cos, sin, num_heads: int, eps: float, act: str,
                       rotate: bool = True):
    """Block i after its attention and block i+1 before its own, as one graph: the residual add
    then fuses with the next RMSNorm instead of a pass of its own over the activations."""
    x = post_attention(x, attn, *post_args, eps, act)
    return (x, *pre_attention(x, *pre_args, cos, sin, num_heads, eps, rotate))


def post_attention(x: torch.Tensor, attn: torch.Tensor, proj_w: torch.Tensor, proj_b: torch.Tensor,
                   norm_w: torch.Tensor, gate_up_w: torch.Tensor, gate_up_b: torch.Tensor, down_w: torch.Tensor,
                   down_b: torch.Tensor, eps: float, act: str) -> torch.Tensor:
    """Output projection, residual, RMSNorm, gated MLP (gate and up as one GEMM), residual."""
    x = x + F.linear(attn.reshape(x.shape[0], -1), proj_w, proj_b)
    gate, up = F.linear(rms_norm(x, norm_w, eps), gate_up_w, gate_up_b).chunk(2, dim=-1)
    return x + F.linear(activation(act)(gate) * up, down_w, down_b)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen2_5_VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.eps = cfg.rms_norm_eps
        self.act = cfg.hidden_act
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg)
        self.mlp = MLP(cfg)

    @torch.no_grad()
    def fuse_mlp(self, multiple: int = 64) -> None:
        """Gate and up projections as one GEMM, the intermediate size zero-padded to ``multiple``.

        Qwen2.5-VL-7B's 3420 makes bf16 rows of 6840 bytes, not 16-byte aligned, which keeps cuBLAS
        off its fastest kernels for the three MLP GEMMs (two thirds of the FLOPs). Zero rows of gate
        and up give silu(0) * 0 = 0 and zero columns of down add nothing, so the result is unchanged.
        The checkpoint's parameters become views into the fused tensors: no second copy is kept.
        """
        m = self.mlp
        inter, dim = m.gate_proj.weight.shape
        padded = _round_up(inter, multiple)
        w = m.gate_proj.weight
        gate_up_w = w.new_zeros(2 * padded, dim)
        gate_up_b = w.new_zeros(2 * padded)
        down_w = w.new_zeros(dim, padded)
        gate_up_w[:inter], gate_up_w[padded:padded + inter] = m.gate_proj.weight, m.up_proj.weight
        gate_up_b[:inter], gate_up_b[padded:padded + inter] = m.gate_proj.bias, m.up_proj.bias
        down_w[:, :inter] = m.down_proj.weight
        m.gate_proj.weight = nn.Parameter(gate_up_w[:inter], requires_grad=False)
        m.gate_proj.bias = nn.Parameter(gate_up_b[:inter], requires_grad=False)
        m.up_proj.weight = nn.Parameter(gate_up_w[padded:padded + inter], requires_grad=False)
        m.up_proj.bias = nn.Parameter(gate_up_b[padded:padded + inter], requires_grad=False)
        m.down_proj.weight = nn.Parameter(down_w[:, :inter], requires_grad=False)
        self.register_buffer("gate_up_w", gate_up_w, persistent=False)
        self.register_buffer("gate_up_b", gate_up_b, persistent=False)
        self.register_buffer("down_w", down_w, persistent=False)

    def pre_args(self) -> tuple[torch.Tensor, ...]:
        return self.norm1.weight, self.attn.qkv.weight, self.attn.qkv.bias

    def post_args(self) -> tuple[torch.Tensor, ...]:
        return (self.attn.proj.weight, self.attn.proj.bias, self.norm2.weight, self.gate_up_w, self.gate_up_b,
                self.down_w, self.mlp.down_proj.bias)


class PatchMerger(nn.Module):
    def __init__(self, cfg: Qwen2_5_VisionConfig) -> None:
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim), nn.GELU(), nn.Linear(self.merged_dim, cfg.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


@dataclass
class Staged:
    """A batch's metadata on the device and its attention plans (Qwen2_5_VisionTower.stage)."""

    window_index: torch.Tensor
    reverse_index: torch.Tensor
    position_ids: torch.Tensor
    windows: Any  # fused_window.WindowPlan, or None where the fused kernel does not run
    plans: dict[bool, Any]  # full attention (True) / window attention (False) -> backend plan


class Qwen2_5_VisionTower(nn.Module):
    def __init__(self, cfg: Qwen2_5_VisionConfig) -> None:
        super().__init__()
        if cfg.head_dim % 4:
            raise ValueError(f"head_dim {cfg.head_dim} must be a multiple of 4 for the 2-D rotary embedding")
        self.cfg = cfg
        self.unit = cfg.spatial_merge_size**2
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        half = cfg.head_dim // 2
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.full_blocks = frozenset(cfg.fullatt_block_indexes)
        self._pre, self._post, self._between = pre_attention, post_attention, between_attentions
        # Window blocks use the fused rotary + window attention kernel where it can run (CUDA,
        # half precision, windows <= 64 tokens); off only to measure what it buys.
        self.fused_windows = True
        # Folded path only: the gate/up GEMM with SwiGLU in its epilogue (models/_swiglu_gemm.py)
        # where it can run (Hopper, half precision, silu); off only to measure what it buys.
        self.fused_swiglu = True
        # Set by fold_norms(): the blocks run the folded path (qwen2_5_vl_folded.py).
        self.folded = False
        self._folded_fns = (folded.rms_scale, folded.qkv_rotary, folded.swiglu)

    def compile(self, mode: str | None = None) -> None:
        """torch.compile the parts between attentions (attention itself stays with the backends).

        Automatic dynamic shapes (``dynamic=None``): the first batch compiles with static sizes, the
        first different token count recompiles once with only that dimension symbolic. Marking every
        dimension dynamic up front (``dynamic=True``) measured 18% slower on the H100 (the hidden
        sizes became symbolic too, bench/RESULTS.md).
        """
        self._pre = torch.compile(pre_attention, fullgraph=True, mode=mode)
        self._post = torch.compile(post_attention, fullgraph=True, mode=mode)
        self._between = torch.compile(between_attentions, fullgraph=True, mode=mode)
        self._folded_fns = tuple(torch.compile(f, fullgraph=True, mode=mode)
                                 for f in (folded.rms_scale, folded.qkv_rotary, folded.swiglu))

    def fold_norms(self) -> None:
        folded.fold_norms(self)

    def rotary(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [N, 2] (h, w) -> [N, 2, head_dim/4] -> [N, head_dim/2] -> [N, head_dim], float32.
        freqs = (position_ids[..., None].float() * self.inv_freq).flatten(1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, meta: BatchMetadata, backend: AttentionBackend) -> torch.Tensor:
        return self.run(pixel_values, self.stage(meta, backend, pixel_values.device, pixel_values.dtype), backend)

    def stage(self, meta: BatchMetadata, backend: AttentionBackend, device: torch.device, dtype: torch.dtype
              ) -> Staged:
        """Every host->device copy of the batch's metadata and every attention plan, once, without a
        sync. What ``run`` reads depends only on the batch's grids, so a staged batch can be reused
        for another batch of the same grids (models/cuda_graphs.py)."""
        windows = None
        if self.fused_windows and fused_window.unavailable_reason(device, dtype) is None:
            windows = fused_window.plan(meta.window.cu_seqlens, meta.window.max_seqlen, device)
        plans = {True: backend.prepare(meta.full)}
        if windows is None:
            plans[False] = backend.prepare(meta.window)
        return Staged(host_to_device(meta.window_index, device), host_to_device(meta.reverse_window_index, device),
                      host_to_device(meta.position_ids, device), windows, plans)

    def run(self, pixel_values: torch.Tensor, staged: Staged, backend: AttentionBackend) -> torch.Tensor:
        """The forward on staged metadata: device work only, no host->device copies."""
        windows, plans = staged.windows, staged.plans
        x = self.patch_embed(pixel_values)
        n, dim = x.shape
        x = x.view(n // self.unit, self.unit, dim)[staged.window_index].view(n, dim)
        cos, sin = self.rotary(staged.position_ids)
        reverse_index = staged.reverse_index
        if self.folded:
            x = folded.run_blocks(self, x, cos, sin, backend, plans, windows)
            return self.merger(x)[reverse_index]
        heads, eps, act = self.cfg.num_heads, self.cfg.rms_norm_eps, self.cfg.hidden_act
        blocks = list(self.blocks)
        # Window blocks whose windows fit the fused kernel take the raw projection and rotate inside it.
        fused = [windows is not None and i not in self.full_blocks for i in range(len(blocks))]
        qkv = self._pre(x, *blocks[0].pre_args(), cos, sin, heads, eps, not fused[0])
        for i, block in enumerate(blocks):
            if fused[i]:
                out = fused_window.window_attention_rotary(qkv[0], cos, sin, windows, heads)
            else:
                out = backend.forward(*qkv, plans[i in self.full_blocks])
            if i + 1 < len(blocks):
                x, *qkv = self._between(x, out, block.post_args(), blocks[i + 1].pre_args(), cos, sin,
                                        heads, eps, act, not fused[i + 1])
            else:
                x = self._post(x, out, *block.post_args(), eps, act)
        return self.merger(x)[reverse_index]


class Qwen2_5_VLVisionModel(Qwen2VLProcessorHooks, VisionModel):
    """A loaded Qwen2.5-VL vision tower with its preprocessing (the public API)."""

    def __init__(self, cfg: Qwen2_5_VisionConfig, module: Qwen2_5_VisionTower, *, model_id: str,
                 preprocess_config: dict | None, device: torch.device, dtype: torch.dtype,
                 attn_backend: str) -> None:
        from ...preprocess import Qwen2VLPreprocessConfig

        self.preprocess_config = Qwen2VLPreprocessConfig.from_dict(preprocess_config or {})
        super().__init__(cfg, module, device=device, dtype=dtype, attn_backend=attn_backend)
        # Whole forwards as CUDA graphs, per batch composition (models/cuda_graphs.py), where the
        # backend's plans can be captured; set_cuda_graphs(0) turns them off.
        self.set_cuda_graphs(DEFAULT_GRAPHS)
        self.spatial = SpatialConfig(cfg.spatial_merge_size, cfg.patch_size, cfg.window_size)
        self.spec = ModelSpec(
            model_id=model_id, model_type=MODEL_TYPE, hidden_size=cfg.out_hidden_size,
            patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
            spatial_merge_size=cfg.spatial_merge_size, in_channels=cfg.in_channels,
            fingerprint={"vision_config": cfg.to_dict(), "preprocess": self.preprocess_config.fingerprint()},
        )

    def set_cuda_graphs(self, capacity: int) -> None:
        """Keep up to ``capacity`` batch compositions as CUDA graphs (0: none). CUDA only, and only
        with a backend whose plans stay valid for replays (``graph_safe``)."""
        from ..cuda_graphs import GraphCache

        usable = self.device.type == "cuda" and self.backend.graph_safe
        self.graphs = GraphCache(capacity) if usable and capacity > 0 else None

    @torch.inference_mode()
    def encode_packed(self, pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]]
                      ) -> tuple[torch.Tensor, tuple[int, ...]]:
        checked = self.validate(pixel_values, grids)
        x = self._pixels_to_device(pixel_values).to(self.dtype)
        if self.graphs is None:
            meta = build_metadata(checked, self.spatial)
            return self.module(x, meta, self.backend), meta.tokens_per_image
        key = tuple(tuple(g) for g in checked)
        out = self.graphs.run(
            key, x, lambda: self.module.stage(build_metadata(checked, self.spatial), self.backend, x.device, x.dtype),
            lambda pixels, staged: self.module.run(pixels, staged, self.backend))
        return out, tuple(self.num_tokens(g) for g in checked)
