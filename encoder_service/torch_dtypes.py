"""The server's torch dtypes, derived by name from the protocol's one table of wire dtypes
(``encoder_client.protocol.dtypes``); the client never imports torch, so this half lives here."""

from __future__ import annotations

import torch
from encoder_client.protocol.dtypes import DTYPES, OUTPUT_DTYPES

# "bfloat16" -> torch.bfloat16, ... for every wire dtype (patches and embeddings).
TORCH_DTYPES: dict[str, torch.dtype] = {d.name: getattr(torch, d.name) for d in DTYPES}

# What a model may run in (--dtype, load_vision_model): the embedding dtypes, by name or short name.
_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
MODEL_DTYPES: dict[str, torch.dtype] = {
    alias: TORCH_DTYPES[name] for name in OUTPUT_DTYPES for alias in (name, _SHORT[name])}


def torch_dtype(name: str) -> torch.dtype:
    """A wire dtype's name -> its torch dtype."""
    return TORCH_DTYPES[name]
