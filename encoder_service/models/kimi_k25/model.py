"""Kimi-K2.5 vision tower (MoonViT-3d) and its projector: Conv2d patch embedding, learnable 2-D
position table resized bicubically to each grid plus a fixed sin-cos embedding per frame, 2-D rotary
on interleaved pairs, pre-LayerNorm blocks with fused QKV and a GELU-tanh MLP, final LayerNorm,
temporal-pooling patch merger (kh x kw blocks averaged over the frames of a clip), MLP projector
into the LLM's hidden size.

Parameter names and the q/k row order are those of the original Kimi-K2.5 checkpoint
(``vision_tower.encoder.blocks.N.wqkv`` with interleaved rotary pairs, ``mm_projector.proj.0``),
so it loads as is; ``kimi_k25_loading`` converts transformers' split, rotate-half layout to it.

Patches stay in raster order inside each frame (as the image processor emits them) until the
merger; attention spans all frames of a chunk (one sequence per chunk). Everything shaped by the
grids (position ids, resize matrices, merge gather, ``cu_seqlens``) comes from host metadata.

Clips (``ModelSpec.frames_per_chunk``, the video processor's ``temporal_patch_size``, 4): a grid of
more frames than that is a clip, its frames consecutive chunks of that many (the last possibly
shorter), exactly as ``Kimi_K25VideoProcessor`` cuts one. ``encode_packed`` expands it into those chunk
grids before building the metadata (the patches are already in that order: a clip's frames' patches,
which are its chunks' patches) and returns each item's chunks' embeddings concatenated in order, each
chunk encoded as transformers encodes one chunk grid. A grid of at most that many frames is one chunk,
as before; the same rule holds for patches a client sends.
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
from ...errors import InvalidInput
from ...metadata import SpatialConfig, pad_attention
from ..base import Decoder, Grid, ModelSpec, VisionModel, validate_batch
from ..cuda_graphs import GraphForward, Slots
from ..layers import activation, patch_conv_as_linear
from . import video
from .metadata import RasterBatchMetadata, bicubic_resample_matrix, build_raster_metadata, expand_clips

MODEL_TYPE = "kimi_k25"
# Rope2DPosEmbRepeated(head_dim, 512, 512) in the original MoonViT-3d: its frequency table stops at
# 512 patches per side and grids beyond it fail there. transformers computes any size, but nothing
# was trained past it and the image processor never emits more (size.max_height = 512 patches).
ROPE_MAX_SIDE = 512


@dataclass(frozen=True)
class KimiK25VisionConfig:
    num_layers: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    patch_size: int = 14
    in_channels: int = 3
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    merge_kernel_size: tuple[int, int] = (2, 2)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-5
    projection_hidden_size: int = 1152  # the projector's input (per patch, before the kh*kw concat)
    projection_layer_norm_eps: float = 1e-5
    text_hidden_size: int = 7168  # the projector's output: the LLM's hidden size
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @classmethod
    def from_config(cls, config: dict) -> KimiK25VisionConfig:
        """From a checkpoint's top-level config.json, in either schema seen in the wild.

        transformers' ``Kimi_K25Config``: ``vision_config.{num_hidden_layers, hidden_size,
        num_attention_heads, pos_emb_height, ...}``, top-level ``projection_hidden_size`` /
        ``projection_layer_norm_eps`` and ``text_config.hidden_size``. The original remote-code
        config (moonshotai/Kimi-K2.5): ``vision_config.{vt_num_hidden_layers, vt_hidden_size,
        vt_num_attention_heads, vt_intermediate_size, init_pos_emb_height, init_pos_emb_width,
        init_pos_emb_time, mm_hidden_size, projector_ln_eps, text_hidden_size}``.
        """
        v = config.get("vision_config")
        if not isinstance(v, dict):
            raise InvalidInput("config.json of a kimi_k25 checkpoint has no vision_config")

        def pick(*names: str, default: Any = None, where: dict = v) -> Any:
            for name in names:
                if where.get(name) is not None:
                    return where[name]
            return default

        hidden = int(pick("hidden_size", "vt_hidden_size", default=cls.hidden_size))
        text = config.get("text_config") or {}
        kernel = pick("merge_kernel_size", default=cls.merge_kernel_size)
        kernel = (int(kernel), int(kernel)) if isinstance(kernel, int) else tuple(int(k) for k in kernel)
        rope = v.get("rope_parameters") or {}
        return cls(
            num_layers=int(pick("num_hidden_layers", "vt_num_hidden_layers", default=cls.num_layers)),
            hidden_size=hidden,
            intermediate_size=int(pick("intermediate_size", "vt_intermediate_size",
                                       default=cls.intermediate_size)),
            num_heads=int(pick("num_attention_heads", "vt_num_attention_heads", default=cls.num_heads)),
            patch_size=int(pick("patch_size", default=cls.patch_size)),
            pos_emb_height=int(pick("pos_emb_height", "init_pos_emb_height", default=cls.pos_emb_height)),
            pos_emb_width=int(pick("pos_emb_width", "init_pos_emb_width", default=cls.pos_emb_width)),
            pos_emb_time=int(pick("pos_emb_time", "init_pos_emb_time", default=cls.pos_emb_time)),
            merge_kernel_size=kernel,
            hidden_act=str(pick("hidden_act", default=cls.hidden_act)),
            rope_theta=float(rope.get("rope_theta", cls.rope_theta)),
            projection_hidden_size=int(pick("projection_hidden_size", where=config)
                                       or pick("mm_hidden_size", default=hidden)),
            projection_layer_norm_eps=float(pick("projection_layer_norm_eps", where=config)
                                            or pick("projector_ln_eps", default=cls.projection_layer_norm_eps)),
            text_hidden_size=int(pick("hidden_size", where=text)
                                 or pick("text_hidden_size", default=None)
                                 or pick("hidden_size", where=config, default=cls.text_hidden_size)),
        )

    def check(self) -> None:
        if self.head_dim * self.num_heads != self.hidden_size or self.head_dim % 4:
            raise InvalidInput(f"kimi_k25: hidden_size {self.hidden_size} / {self.num_heads} heads must give a "
                               "head_dim that is a multiple of 4 (2-D rotary on interleaved pairs)")
        if self.merge_kernel_size[0] != self.merge_kernel_size[1]:
            raise InvalidInput(f"kimi_k25: merge_kernel_size {list(self.merge_kernel_size)} is not square")
        if self.projection_hidden_size != self.hidden_size:
            raise InvalidInput(f"kimi_k25: projection_hidden_size {self.projection_hidden_size} differs from the "
                               f"vision hidden_size {self.hidden_size}")

    def to_dict(self) -> dict:
        """transformers' ``Kimi_K25VisionConfig`` field names (plus the projector's sizes)."""
        return {
            "num_hidden_layers": self.num_layers, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_heads,
            "patch_size": self.patch_size, "pos_emb_height": self.pos_emb_height,
            "pos_emb_width": self.pos_emb_width, "pos_emb_time": self.pos_emb_time,
            "merge_kernel_size": list(self.merge_kernel_size), "hidden_act": self.hidden_act,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
            "projection_hidden_size": self.projection_hidden_size,
            "projection_layer_norm_eps": self.projection_layer_norm_eps,
            "text_hidden_size": self.text_hidden_size,
        }


def time_sincos_table(dim: int, num_frames: int) -> torch.Tensor:
    """float32 [num_frames, dim]: frame f -> [sin(f * w_i), cos(f * w_i)], w_i = 10000^(-2i/dim).

    ``get_1d_sincos_pos_embed`` of the original (numpy float32). Frame 0 is [0.., 1..], not zero:
    the original adds it to every frame of a multi-frame clip and adds nothing to a single image.
    """
    omega = np.arange(dim // 2, dtype=np.float32)
    omega /= dim / 2.0
    omega = 1.0 / 10000**omega
    out = np.einsum("m,d->md", np.arange(num_frames, dtype=np.float32), omega)
    return torch.from_numpy(np.concatenate([np.sin(out), np.cos(out)], axis=1).astype(np.float32))


class PosEmbed(nn.Module):
    """The learnable (H, W, D) table; ``weight`` is ``patch_embed.pos_emb.weight`` in the original."""

    def __init__(self, cfg: KimiK25VisionConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: KimiK25VisionConfig) -> None:
        super().__init__()
        # Conv2d-shaped so checkpoints load unchanged; kernel == stride, so applied as one GEMM on
        # the flattened (C, P, P) patches.
        self.proj = nn.Conv2d(cfg.in_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size, bias=True)
        self.pos_emb = PosEmbed(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return patch_conv_as_linear(x, self.proj)


class MLP(nn.Module):
    def __init__(self, cfg: KimiK25VisionConfig) -> None:
        super().__init__()
        self.fc0 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc1 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(self.act(self.fc0(x)))


def apply_rotary_interleaved(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates pairs (2i, 2i+1) of [tokens, heads, head_dim] by float32 angles [tokens, head_dim/2].

    The real form of the original's complex product ``view_as_complex(x) * freqs_cis``, in float32.
    """
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x.float().unflatten(-1, (-1, 2))
        re, im = pairs[..., 0], pairs[..., 1]
        return torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2).to(x.dtype)

    return rotate(q), rotate(k)


class EncoderBlock(nn.Module):
    def __init__(self, cfg: KimiK25VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.norm0 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend, prepared: Any) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(self.norm0(x)).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary_interleaved(q, k, cos, sin)
        x = x + self.wo(backend.forward(q, k, v, prepared).reshape(n, -1))
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, cfg: KimiK25VisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


class Projector(nn.Module):
    """``mm_projector`` (PatchMergerMLP): LayerNorm per patch, concat kh*kw patches, Linear-GELU-Linear."""

    def __init__(self, cfg: KimiK25VisionConfig) -> None:
        super().__init__()
        merged = cfg.projection_hidden_size * cfg.merge_unit
        self.merged_dim = merged
        self.pre_norm = nn.LayerNorm(cfg.projection_hidden_size, eps=cfg.projection_layer_norm_eps)
        # Exact GELU here, GELU-tanh in the blocks: as in the original (nn.GELU() vs PytorchGELUTanh).
        self.proj = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, cfg.text_hidden_size))

    def forward(self, slots: torch.Tensor) -> torch.Tensor:
        return self.proj(self.pre_norm(slots).reshape(-1, self.merged_dim))


class KimiK25VisionTower(nn.Module):
    """``vision_tower`` + ``mm_projector`` of the original checkpoint, under those two names."""

    def __init__(self, cfg: KimiK25VisionConfig) -> None:
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.vision_tower = nn.Module()
        self.vision_tower.patch_embed = PatchEmbed(cfg)
        self.vision_tower.encoder = Encoder(cfg)
        self.mm_projector = Projector(cfg)
        self.register_buffer("inv_freq", self.rope_inv_freq(cfg), persistent=False)
        self.register_buffer("time_table", time_sincos_table(cfg.hidden_size, cfg.pos_emb_time), persistent=False)

    @staticmethod
    def rope_inv_freq(cfg: KimiK25VisionConfig) -> torch.Tensor:
        # The original's Rope2DPosEmb: theta^(-4i/head_dim), i < head_dim/4, shared by both axes.
        d = cfg.head_dim
        # Made on the CPU, whatever the device context: loading builds the tower under torch.device("meta"), where
        # arange runs torch's reference implementation, which imports torch._dynamo (1.7 s of every server and
        # worker start). Loading replaces the buffer with one on the model's device.
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 4, dtype=torch.float32, device="cpu")[: d // 4] / d))

    def rotary(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Pair 2i rotates by w * f_i, pair 2i+1 by h * f_i (x before y, as the original's freqs_cis).
        hw = position_ids.float()
        angles = torch.stack((hw[:, 1:2] * self.inv_freq, hw[:, 0:1] * self.inv_freq), dim=-1).flatten(1)
        return angles.cos(), angles.sin()

    def position_embedding(self, grids: Sequence[Grid]) -> torch.Tensor:
        """[patches, D]: the table resized to each (h, w), plus the frame's sin-cos row when t > 1."""
        table = self.vision_tower.patch_embed.pos_emb.weight
        side_h, side_w, dim = table.shape
        device = table.device
        resized: dict[tuple[int, int], torch.Tensor] = {}
        parts = []
        for t, h, w in grids:
            if (h, w) not in resized:
                if (h, w) == (side_h, side_w):
                    pos = table.reshape(h * w, dim)  # the original skips the resize at the table's size
                else:
                    # Copies: the cached matrices are read-only and torch wants writable memory.
                    wh = host_to_device(bicubic_resample_matrix(h, side_h).copy(), device).to(table.dtype)
                    ww = host_to_device(bicubic_resample_matrix(w, side_w).copy(), device).to(table.dtype)
                    rows = (wh @ table.reshape(side_h, side_w * dim)).view(h, side_w, dim)
                    pos = torch.matmul(ww, rows).reshape(h * w, dim)
                resized[(h, w)] = pos
            pos = resized[(h, w)]
            if t > 1:
                pos = (pos.unsqueeze(0) + self.time_table[:t, None, :].to(pos.dtype)).reshape(t * h * w, dim)
            parts.append(pos)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def forward(self, pixel_values: torch.Tensor, meta: RasterBatchMetadata, backend: AttentionBackend
                ) -> torch.Tensor:
        return self.run(pixel_values, self.prepare(meta, backend, pixel_values.device), backend)

    def prepare(self, meta: RasterBatchMetadata, backend: AttentionBackend, device: torch.device) -> Prepared:
        """What depends on the batch's grids: host-to-device copies, the attention plan and the
        position table resampled to each grid (device work, eager: a graph replays only ``run``)."""
        pool = meta.pool
        frames = host_to_device(pool.frames, device) if pool.max_frames > 1 else None
        return Prepared(host_to_device(meta.position_ids, device), host_to_device(pool.index, device), frames,
                      pool.max_frames, self.position_embedding(meta.grids), backend.prepare(meta.attention))

    def run(self, pixel_values: torch.Tensor, prepared: Prepared, backend: AttentionBackend) -> torch.Tensor:
        """The forward on prepared metadata: device work only."""
        tower = self.vision_tower
        x = tower.patch_embed(pixel_values)
        x = x + prepared.position_embedding.to(x.dtype)
        cos, sin = self.rotary(prepared.position_ids)
        for block in tower.encoder.blocks:
            x = block(x, cos, sin, backend, prepared.plan)
        x = tower.encoder.final_layernorm(x)

        if prepared.max_frames == 1:
            slots = x[prepared.pool_index[:, 0]]  # images only: the merger is a pure reordering
        else:
            padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
            slots = padded[prepared.pool_index].sum(dim=1) / prepared.pool_frames.to(x.dtype)[:, None]
        return self.mm_projector(slots)


@dataclass
class Prepared:
    """A batch's metadata on the device (``KimiK25VisionTower.prepare``)."""

    position_ids: torch.Tensor  # int64 [patches, 2]
    pool_index: torch.Tensor  # int64 [slots, max_frames]
    pool_frames: torch.Tensor | None  # float32 [slots], clips only
    max_frames: int
    position_embedding: torch.Tensor  # [patches, hidden] in the table's dtype
    plan: Any  # the backend's plan for one sequence per image


class KimiK25VisionModel(VisionModel):
    """A loaded Kimi-K2.5 vision tower + projector with its preprocessing (the public API)."""

    VIDEO = video.VIDEO

    def __init__(self, cfg: KimiK25VisionConfig, module: KimiK25VisionTower, *, model_id: str,
                 preprocess_config: dict | None, device: torch.device, dtype: torch.dtype,
                 attn_backend: str, ops: str = "auto", video_config: dict | None = None) -> None:
        from .preprocess import KimiK25PreprocessConfig

        self.preprocess_config = KimiK25PreprocessConfig.from_dict(preprocess_config or {})
        self._bind_video(video_config, cfg, model_id, image_file=preprocess_config)
        super().__init__(cfg, module, device=device, dtype=dtype, attn_backend=attn_backend, ops=ops)
        self.kernel = cfg.merge_kernel_size[0]
        self.spatial = SpatialConfig(self.kernel, cfg.patch_size)
        chunk = self.video_config.temporal_patch_size
        self.spec = ModelSpec(
            model_id=model_id, model_type=MODEL_TYPE, hidden_size=cfg.text_hidden_size,
            patch_size=cfg.patch_size, temporal_patch_size=1, spatial_merge_size=self.kernel,
            in_channels=cfg.in_channels,
            frames_merged=True, frames_per_chunk=chunk,  # the merger averages each chunk's frames
            fingerprint={"vision_config": cfg.to_dict(), "preprocess": self.preprocess_config.fingerprint(),
                         **self._video_fingerprint()},
        )

    def decoder(self) -> Decoder:
        from .preprocess import decode_kimi_k25, geometry

        return Decoder(decode_kimi_k25, self.preprocess_config, self.preprocess_mode, geometry)

    def _value_table(self) -> torch.Tensor:
        from .preprocess import value_table

        return value_table(self.preprocess_config)

    def _patchify(self, image: torch.Tensor) -> torch.Tensor:
        from .preprocess import patchify

        return patchify(image, self.preprocess_config)

    def validate(self, pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]]) -> list[Grid]:
        # Any t: a grid of more than spec.frames_per_chunk (<= pos_emb_time) frames is a clip of chunks.
        checked = validate_batch(pixel_values, grids, self.spec)
        for i, (t, h, w) in enumerate(checked):
            if h > ROPE_MAX_SIDE or w > ROPE_MAX_SIDE:
                raise InvalidInput(f"grid [{t}, {h}, {w}] has a side over {ROPE_MAX_SIDE} patches, the most "
                                   "the 2-D rotary embedding covers", image_index=i)
        return checked

    @torch.inference_mode()
    def encode_packed(self, pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]]
                      ) -> tuple[torch.Tensor, tuple[int, ...]]:
        # transformers' processor returns [patches, C, P, P]; the wire format is [patches, C*P*P].
        if pixel_values.ndim == 4:
            pixel_values = pixel_values.reshape(pixel_values.shape[0], -1)
        chunks, counts = expand_clips(self.validate(pixel_values, grids), self.spec.frames_per_chunk)
        # A chunk's rows: one per merged token of a frame (its frames are pooled).
        per_chunk, tokens, start = [h * w // self.spatial.merge_unit for _, h, w in chunks], [], 0
        for n in counts:  # each item's rows: its chunks' rows, in order
            tokens.append(sum(per_chunk[start:start + n]))
            start += n
        x = self._pixels_to_device(pixel_values).to(self.dtype)
        replayed = self._replayed(x, chunks, tuple(tokens))
        if replayed is not None:
            return replayed
        meta = build_raster_metadata(chunks, self.spatial)
        return self.module(x, meta, self.backend), tuple(tokens)

    def graph_forward(self, backend) -> GraphForward:
        """Token budgets' graphs of images: one pattern, ``slots.full`` images of up to the budget.
        A clip's pooling over its frames changes the merger's shape: batches with one run eagerly."""
        spatial, module = self.spatial, self.module

        def pad(meta: RasterBatchMetadata, budget: int, slots: Slots) -> RasterBatchMetadata:
            return dataclasses.replace(meta, attention=pad_attention(meta.attention, slots.full(budget), budget))

        return GraphForward(metadata=lambda grids: build_raster_metadata(grids, spatial), pad=pad,
                            prepare=lambda meta: module.prepare(meta, backend, self.device),
                            run=lambda pixels, prepared: module.run(pixels, prepared, backend),
                            merge=spatial.spatial_merge_size)
