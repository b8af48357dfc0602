"""Qwen2.5-VL vision tower: patch embedding, 2-D rotary, window attention with full-attention
blocks, RMSNorm, SwiGLU MLP, patch merger. Batches many images of different sizes in one forward.

Parameter names follow the checkpoints (``patch_embed.proj``, ``blocks.N.attn.qkv``, ...), so a
state dict loads as is after stripping ``visual.`` / ``model.visual.``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ...attention import AttentionBackend
from ...device import host_to_device
from ...metadata import BatchMetadata, SpatialConfig, build_metadata, pad_attention
from ...ops import AUTO, OpsSelection, OpTarget, select_ops
from ..base import ModelSpec, VisionModel
from ..cuda_graphs import GraphForward, Slots
from ..layers import ConvPatchEmbed3d, QkvProjections, RMSNorm
from . import folded, video
from .processor import Qwen2VLProcessorHooks

MODEL_TYPE = "qwen2_5_vl"
# The fused operations the blocks ask the ops layer for (folded.run_blocks), never a kernel by name.
OPS = ("window_attention", "rms_scale", "gated_mlp")
# And with --quantization fp8 (folded.run_blocks_fp8).
FP8_OPS = ("rms_quant", "fp8_gated_mlp")


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


class MLP(nn.Module):
    def __init__(self, cfg: Qwen2_5_VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen2_5_VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = QkvProjections(cfg.hidden_size)
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
class Prepared:
    """A batch's metadata on the device and its attention plans (Qwen2_5_VisionTower.prepare)."""

    window_index: torch.Tensor
    reverse_index: torch.Tensor
    position_ids: torch.Tensor
    full_plan: Any  # the attention backend's, for the full-attention layers
    window_plan: Any  # the window_attention provider's (the backend's where it goes through it)


class Qwen2_5_VisionTower(nn.Module):
    def __init__(self, cfg: Qwen2_5_VisionConfig) -> None:
        super().__init__()
        if cfg.head_dim % 4:
            raise ValueError(f"head_dim {cfg.head_dim} must be a multiple of 4 for the 2-D rotary embedding")
        self.cfg = cfg
        self.unit = cfg.spatial_merge_size**2
        self.patch_embed = ConvPatchEmbed3d(cfg.in_channels, cfg.hidden_size, cfg.temporal_patch_size,
                                            cfg.patch_size, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        half = cfg.head_dim // 2
        # Made on the CPU, whatever the device context: loading builds the tower under torch.device("meta"), where
        # arange runs torch's reference implementation, which imports torch._dynamo (1.7 s of every server and
        # worker start). Loading replaces the buffer with one on the model's device.
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device="cpu") / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.full_blocks = frozenset(cfg.fullatt_block_indexes)
        # The fused operations' providers (encoder_service/ops), chosen by the model at load time
        # (Qwen2_5_VLVisionModel); plain torch until then.
        self.ops: OpsSelection = select_ops("torch", None, OPS, attention_named=True)

    # torch.compile's mode once compile() ran (a re-selection of providers compiles the new ones).
    compiled: tuple[str | None] | None = None

    def compile(self, mode: str | None = None) -> None:
        """torch.compile the plain-torch parts between GEMMs and attention (the ops' torch providers;
        kernels and attention stay as they are)."""
        self.ops.compile(mode)
        self.compiled = (mode,)

    def rotary(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [N, 2] (h, w) -> [N, 2, head_dim/4] -> [N, head_dim/2] -> [N, head_dim], float32.
        freqs = (position_ids[..., None].float() * self.inv_freq).flatten(1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, meta: BatchMetadata, backend: AttentionBackend) -> torch.Tensor:
        return self.run(pixel_values, self.prepare(meta, backend, pixel_values.device, pixel_values.dtype), backend)

    def prepare(self, meta: BatchMetadata, backend: AttentionBackend, device: torch.device, dtype: torch.dtype
                ) -> Prepared:
        """Every host->device copy of the batch's metadata and every attention plan, once, without a
        sync. What ``run`` reads depends only on the batch's grids (a graph replays ``run`` on the
        prepared metadata of each batch, copied into its buffers: models/cuda_graphs.py)."""
        return Prepared(host_to_device(meta.window_index, device), host_to_device(meta.reverse_window_index, device),
                        host_to_device(meta.position_ids, device), backend.prepare(meta.full),
                        self.ops.prepare_windows(meta.window, backend, device))

    def run(self, pixel_values: torch.Tensor, prepared: Prepared, backend: AttentionBackend) -> torch.Tensor:
        """The forward on prepared metadata: device work only, no host->device copies."""
        x = self.patch_embed(pixel_values)
        n, dim = x.shape
        x = x.view(n // self.unit, self.unit, dim)[prepared.window_index].view(n, dim)
        cos, sin = self.rotary(prepared.position_ids)
        x = folded.run_blocks(self, x, cos, sin, backend, prepared)
        return self.merger(x)[prepared.reverse_index]


class Qwen2_5_VLVisionModel(Qwen2VLProcessorHooks, VisionModel):
    """A loaded Qwen2.5-VL vision tower with its preprocessing (the public API)."""

    OPS = OPS
    FP8_OPS = FP8_OPS
    VIDEO = video.VIDEO

    def __init__(self, cfg: Qwen2_5_VisionConfig, module: Qwen2_5_VisionTower, *, model_id: str,
                 preprocess_config: dict | None, device: torch.device, dtype: torch.dtype,
                 attn_backend: str, ops: str = AUTO, video_config: dict | None = None) -> None:
        from .preprocess import Qwen2VLPreprocessConfig

        self.preprocess_config = Qwen2VLPreprocessConfig.from_dict(preprocess_config or {})
        self._bind_video(video_config, cfg, model_id, image_file=preprocess_config)
        super().__init__(cfg, module, device=device, dtype=dtype, attn_backend=attn_backend, ops=ops)
        module.ops = self.ops
        self.spatial = SpatialConfig(cfg.spatial_merge_size, cfg.patch_size, cfg.window_size)
        self.spec = ModelSpec(
            model_id=model_id, model_type=MODEL_TYPE, hidden_size=cfg.out_hidden_size,
            patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
            spatial_merge_size=cfg.spatial_merge_size, in_channels=cfg.in_channels,
            fingerprint={"vision_config": cfg.to_dict(), "preprocess": self.preprocess_config.fingerprint(),
                         **self._video_fingerprint()},
        )

    def _ops_target(self) -> OpTarget:
        cfg = self.cfg
        windows = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size  # merge blocks per side
        return OpTarget(self.device, self.dtype, head_dim=cfg.head_dim, hidden_size=cfg.hidden_size,
                        intermediate_size=self.module.blocks[0].down_w.shape[1], activation=cfg.hidden_act,
                        window_tokens=windows * windows * cfg.spatial_merge_size**2)

    def _quantize_fp8(self) -> None:
        self.ops = select_ops(self._ops_spec, self._ops_target(), OPS + FP8_OPS,
                              attention_named=self._attention_named)
        self.module.ops = self.ops
        folded.quantize_blocks(self.module)
        if self.module.compiled is not None:  # the new providers' torch functions, as the rest
            self.module.compile(*self.module.compiled)

    def graph_forward(self, backend) -> GraphForward:
        """Token budgets' graphs: the full-attention pattern holds ``slots.full`` frames of up to
        the budget; the window pattern ``slots.windows``, each of up to a window."""
        spatial, module = self.spatial, self.module
        window_tokens = spatial.window_blocks ** 2 * spatial.merge_unit

        def pad(meta: BatchMetadata, budget: int, slots: Slots) -> BatchMetadata:
            return dataclasses.replace(
                meta, full=pad_attention(meta.full, slots.full(budget), budget),
                window=pad_attention(meta.window, slots.windows(budget, window_tokens, spatial.merge_unit),
                                     window_tokens))

        return GraphForward(metadata=lambda grids: build_metadata(grids, spatial), pad=pad,
                            prepare=lambda meta: module.prepare(meta, backend, self.device, self.dtype),
                            run=lambda pixels, prepared: module.run(pixels, prepared, backend),
                            merge=spatial.spatial_merge_size)

    @torch.inference_mode()
    def encode_packed(self, pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]]
                      ) -> tuple[torch.Tensor, tuple[int, ...]]:
        return self._encode_grids(pixel_values, grids, lambda checked: build_metadata(checked, self.spatial))
