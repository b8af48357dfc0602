"""Qwen3-VL / Qwen3.5 vision tower: Conv3d patch embedding (applied as one GEMM), a learned square
position table resampled bilinearly to each grid, 2-D rotary (rotate-half), pre-LayerNorm blocks
with fused QKV and a GELU-tanh MLP, full attention within each frame, a patch merger, and (Qwen3-VL)
deepstack mergers reading the hidden states after chosen blocks.

Parameter names are transformers' (``patch_embed.proj``, ``pos_embed``, ``blocks.N.attn.qkv``,
``merger.linear_fc1``, ``deepstack_merger_list.N.norm``, ...), so a checkpoint loads after
stripping ``model.visual.``. Patches stay in merge-block order throughout, as the processor emits
them. Every shape-dependent input comes from the host metadata (metadata.py), copied to the device
once per batch; the forward never reads a device value on the host.

Operations are those of transformers in the same order (float32 statistics in LayerNorm as torch
does, rotary and the position-embedding sum in float32), so float32 on the CPU agrees to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...attention import AttentionBackend
from ...device import host_to_device
from ..layers import (
    ConvPatchEmbed3d,
    QkvProjections,
    apply_rotary,
    compiled,
    linear,
    linear_activation,
    quantize_weight,
    scaled_linear,
)
from .config import Qwen3VLVisionConfig
from .metadata import INDEX_COLUMNS, POSITION_COLUMNS, WEIGHT_COLUMNS, Qwen3VLBatchMetadata

# transformers hard-codes this epsilon for every LayerNorm of the tower (blocks and mergers).
LAYER_NORM_EPS = 1e-6


def rope_inv_freq(cfg: Qwen3VLVisionConfig) -> torch.Tensor:
    """float32 [head_dim / 4]: the frequencies shared by the row and the column halves."""
    half = cfg.head_dim // 2
    # Made on the CPU, whatever the device context: loading builds the tower under torch.device("meta"), where
    # arange runs torch's reference implementation, which imports torch._dynamo (1.7 s of every server and
    # worker start). Loading replaces the buffer with one on the model's device.
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device="cpu") / half))


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3VLVisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)


class Block(nn.Module):
    """The parameters of one block; its computation is ``pre_attention`` / ``post_attention``."""

    def __init__(self, cfg: Qwen3VLVisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = QkvProjections(cfg.hidden_size)
        self.mlp = MLP(cfg)

    # --quantization fp8: each linear's (e4m3 weight, per-row scales), by name (``quantize_fp8``).
    fp8: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """The four linears of the block in e4m3 (ops/fp8.py); the LayerNorms stay as they are, and the
        activations are quantised per token inside the compiled graphs, fused with the op before."""
        self.fp8 = {name: quantize_weight(layer.weight) for name, layer in
                    (("qkv", self.attn.qkv), ("proj", self.attn.proj), ("fc1", self.mlp.linear_fc1),
                     ("fc2", self.mlp.linear_fc2))}

    def _weight(self, name: str, layer: nn.Linear):
        return self.fp8[name] if self.fp8 is not None else layer.weight

    def pre_args(self) -> tuple:
        return self.norm1.weight, self.norm1.bias, self._weight("qkv", self.attn.qkv), self.attn.qkv.bias

    def post_args(self) -> tuple:
        return (self._weight("proj", self.attn.proj), self.attn.proj.bias, self.norm2.weight, self.norm2.bias,
                self._weight("fc1", self.mlp.linear_fc1), self.mlp.linear_fc1.bias,
                self._weight("fc2", self.mlp.linear_fc2), self.mlp.linear_fc2.bias)


# A block's work outside attention, as plain functions of tensors: torch.compile (on CUDA) fuses
# each into few kernels; on the CPU they run as written, transformers' operations in its order.
def pre_attention(x: torch.Tensor, norm_w: torch.Tensor, norm_b: torch.Tensor, qkv_w: torch.Tensor,
                  qkv_b: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, padded: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm, fused QKV projection, rotary; with ``padded`` (the backend's padded_head_dim), q, k
    and v zero-padded to that head_dim in the same pass, where a backend would copy them itself."""
    qkv = linear(F.layer_norm(x, (x.shape[-1],), norm_w, norm_b, LAYER_NORM_EPS), qkv_w, qkv_b)
    q, k, v = qkv.view(x.shape[0], 3, num_heads, -1).unbind(1)
    q, k = apply_rotary(q, k, cos, sin)
    if padded:
        return tuple(F.pad(t, (0, padded - t.shape[-1])) for t in (q, k, v))
    # Contiguous: kernels that want [T, H, D] packed would otherwise copy it themselves.
    return q, k, v.contiguous()


def merged_heads(attn: torch.Tensor, width: int) -> torch.Tensor:
    """Attention's [tokens, heads, head_dim] output as [tokens, width] rows; heads handed back padded
    (padded_head_dim) lose their zero columns here, inside the compiled graph."""
    if attn.shape[1] * attn.shape[2] != width:
        attn = attn[..., : width // attn.shape[1]]
    return attn.reshape(attn.shape[0], width)


def post_attention(x: torch.Tensor, attn: torch.Tensor, proj_w: torch.Tensor, proj_b: torch.Tensor,
                   norm_w: torch.Tensor, norm_b: torch.Tensor, fc1_w: torch.Tensor, fc1_b: torch.Tensor,
                   fc2_w: torch.Tensor, fc2_b: torch.Tensor, act: str) -> torch.Tensor:
    """Output projection, residual, LayerNorm, MLP, residual."""
    x = residual(x, linear(merged_heads(attn, x.shape[-1]), proj_w, proj_b))
    h = F.layer_norm(x, (x.shape[-1],), norm_w, norm_b, LAYER_NORM_EPS)
    return residual(x, linear(linear_activation(h, fc1_w, fc1_b, act), fc2_w, fc2_b))


def residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y``, as torch adds two bf16 tensors (in float32, rounded once), written so that inductor
    does not turn it into the GEMM's C operand: its addmm then first copies x into the output, a
    0.22 ms pass per block at 8 x 1024x1024 that the add fused into the next LayerNorm does not cost
    (bench/RESULTS.md, the H200 profile)."""
    return (x.float() + y.float()).to(x.dtype)


def between_attentions(x, attn, post_args, pre_args, cos, sin, num_heads: int, act: str, padded: int = 0):
    """Block i after its attention and block i+1 before its own, as one graph: the residual add
    fuses with the next LayerNorm."""
    x = post_attention(x, attn, *post_args, act)
    return (x, *pre_attention(x, *pre_args, cos, sin, num_heads, padded))


# --quantization fp8: the MLP's activation and the quantisation of its output run between two graphs,
# in the ``act_quant`` op (one pass over the row, where inductor's fused kernel read it twice).
def mid_fp8(x, attn, proj_w, proj_b, norm_w, norm_b, fc1_w, fc1_b):
    """Output projection, residual, LayerNorm, the MLP's first GEMM: (x, its pre-activation)."""
    x = residual(x, linear(merged_heads(attn, x.shape[-1]), proj_w, proj_b))
    return x, linear(F.layer_norm(x, (x.shape[-1],), norm_w, norm_b, LAYER_NORM_EPS), fc1_w, fc1_b)


def tail_fp8(x, hq, h_scale, fc2_wq, fc2_scale, fc2_b):
    """The MLP's second GEMM on the quantised activation, and the residual."""
    return residual(x, scaled_linear(hq, h_scale, fc2_wq, fc2_scale, fc2_b, x.dtype))


def tail_between_fp8(x, hq, h_scale, fc2_wq, fc2_scale, fc2_b, pre_args, cos, sin, num_heads: int,
                     padded: int = 0):
    """``tail_fp8``, then block i+1 before its attention, as one graph."""
    x = tail_fp8(x, hq, h_scale, fc2_wq, fc2_scale, fc2_b)
    return (x, *pre_attention(x, *pre_args, cos, sin, num_heads, padded))


class PatchMerger(nn.Module):
    """LayerNorm, the merge block's ``spatial_merge_size**2`` patches concatenated (adjacent rows in
    merge-block order), Linear-GELU-Linear into the LLM's width. The main merger normalises each
    patch (``postshuffle=False``); the deepstack mergers normalise the concatenated row."""

    def __init__(self, cfg: Qwen3VLVisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.merge_unit
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle else cfg.hidden_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim, bias=True)
        self.linear_fc2 = nn.Linear(self.merged_dim, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Deepstack: the concatenated row normalised; main: each patch, then concatenated.
        x = self.norm(x.view(-1, self.merged_dim)) if self.postshuffle else self.norm(x).view(-1, self.merged_dim)
        # Exact GELU here, GELU-tanh (hidden_act) in the blocks, as transformers' nn.GELU().
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


@dataclass
class Prepared:
    """A batch's metadata on the device and its attention plan (``Qwen3VLVisionTower.prepare``)."""

    packed: torch.Tensor  # float32 [patches, PACKED_WIDTH] (metadata.py)
    plan: Any  # the backend's plan for one sequence per frame


class Qwen3VLVisionTower(nn.Module):
    def __init__(self, cfg: Qwen3VLVisionConfig) -> None:
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.patch_embed = ConvPatchEmbed3d(cfg.in_channels, cfg.hidden_size, cfg.temporal_patch_size,
                                            cfg.patch_size, bias=True)
        # Its weights always come from the state dict: no random init (which, under the meta device that
        # loading builds the tower on, runs torch's reference normal_ and imports torch._dynamo: 1.7 s a start).
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size,
                                      _weight=torch.empty(cfg.num_position_embeddings, cfg.hidden_size))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle=True) for _ in cfg.deepstack_visual_indexes)
        # block index -> its deepstack merger (the config keeps the indexes increasing).
        self.deepstack_after = {block: j for j, block in enumerate(cfg.deepstack_visual_indexes)}
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._pre, self._post, self._between = pre_attention, post_attention, between_attentions
        self._mid, self._tail, self._tail_between = mid_fp8, tail_fp8, tail_between_fp8
        # --quantization fp8: the model's selection holding ``act_quant`` (Qwen3VLVisionModel), else None.
        self.ops: Any = None

    def quantize_fp8(self) -> None:
        """``--quantization fp8``: every block's linears in e4m3; the patch embedding and the mergers
        stay in the activation dtype (9% of the FLOPs, and the last GEMMs before the LLM)."""
        for block in self.blocks:
            block.quantize_fp8()

    compiled: tuple[str | None] | None = None  # torch.compile's mode once compile() ran

    def compile(self, mode: str | None = None) -> None:
        """torch.compile the work between attentions (attention stays with the backend). Automatic
        dynamic shapes: a second token count recompiles once with that dimension symbolic."""
        self._pre = compiled(pre_attention, mode)
        self._post = compiled(post_attention, mode)
        self._between = compiled(between_attentions, mode)
        self._mid = compiled(mid_fp8, mode)
        self._tail = compiled(tail_fp8, mode)
        self._tail_between = compiled(tail_between_fp8, mode)
        if self.ops is not None:  # quantised first: its providers' torch functions too
            self.ops.compile(mode)
        self.compiled = (mode,)

    def forward(self, pixel_values: torch.Tensor, meta: Qwen3VLBatchMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """[patches, patch_dim] -> [tokens, feature_levels * out_hidden_size]: the main merger's
        output, then each deepstack level in the order of ``deepstack_visual_indexes``."""
        return self.run(pixel_values, self.prepare(meta, backend, pixel_values.device), backend)

    def prepare(self, meta: Qwen3VLBatchMetadata, backend: AttentionBackend, device: torch.device) -> Prepared:
        """The batch's one host-to-device copy and its attention plan; no sync."""
        return Prepared(host_to_device(meta.packed(), device), backend.prepare(meta.attention))

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [N, 2] (row, col) -> [N, 2, head_dim/4] -> [N, head_dim/2] (rows' angles, then columns')
        # -> [N, head_dim] twice over for rotate-half, float32.
        freqs = (positions[..., None] * self.inv_freq).flatten(1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def position_embedding(self, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """float32 [N, hidden]: the 4 weighted table rows of each patch, summed tap by tap in the
        reference's order (one [N, hidden] temporary per tap instead of an [N, 4, hidden] one)."""
        table = self.pos_embed.weight
        out = table[indices[:, 0]] * weights[:, 0:1]
        for tap in range(1, indices.shape[1]):
            out = out + table[indices[:, tap]] * weights[:, tap:tap + 1]
        return out

    def run(self, pixel_values: torch.Tensor, prepared: Prepared, backend: AttentionBackend) -> torch.Tensor:
        """The forward on prepared metadata: device work only."""
        packed = prepared.packed
        x = self.patch_embed(pixel_values)
        pos = self.position_embedding(packed[:, INDEX_COLUMNS].long(), packed[:, WEIGHT_COLUMNS])
        x = x + pos.to(x.dtype)
        cos, sin = self.rotary(packed[:, POSITION_COLUMNS])
        levels: list[torch.Tensor] = []
        heads, act, blocks = self.cfg.num_heads, self.cfg.hidden_act, list(self.blocks)
        pad = backend.padded_head_dim or 0  # the head_dim the backend's kernel runs at, when wider
        qkv = self._pre(x, *blocks[0].pre_args(), cos, sin, heads, pad)
        for i, block in enumerate(blocks):
            out = backend.forward(*qkv, prepared.plan)
            last = i + 1 == len(blocks)
            if block.fp8 is not None:
                post = block.post_args()
                x, pre_act = self._mid(x, out, *post[:6])
                hq, h_scale = self.ops.act_quant(pre_act, act)
                if last:
                    x = self._tail(x, hq, h_scale, *post[6], post[7])
                else:
                    x, *qkv = self._tail_between(x, hq, h_scale, *post[6], post[7], blocks[i + 1].pre_args(),
                                                 cos, sin, heads, pad)
            elif not last:
                x, *qkv = self._between(x, out, block.post_args(), blocks[i + 1].pre_args(), cos, sin, heads, act,
                                        pad)
            else:
                x = self._post(x, out, *block.post_args(), act)
            if i in self.deepstack_after:
                levels.append(self.deepstack_merger_list[self.deepstack_after[i]](x))
        main = self.merger(x)
        return torch.cat([main, *levels], dim=-1) if levels else main
