"""The reference backend: torch's scaled_dot_product_attention, one call per sequence.

Runs anywhere. The split points are host ints from the CPU metadata, so the loop never asks the
device for a length. Slow on a GPU for many small sequences; the fast backends exist for that.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F

from ..metadata import AttentionMetadata
from .base import AttentionBackend


class SDPABackend(AttentionBackend):
    name = "sdpa"
    priority = 0

    def prepare_ragged(self, meta: AttentionMetadata) -> list[tuple[int, int]]:
        return list(pairwise(meta.split_points()))

    def forward_ragged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                prepared: list[tuple[int, int]]) -> torch.Tensor:
        out = torch.empty_like(q)
        for start, end in prepared:
            # [S, H, D] -> [1, H, S, D]: the layout transformers' reference feeds SDPA.
            qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs).squeeze(0).transpose(0, 1)
        return out
