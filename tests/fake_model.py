"""A fake VisionModel for fast in-process engine tests (the ``fake_model`` fixture of tests/conftest.py
is one; tests that need the class itself import it from here)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from encoder_service.models.base import Decoder, ModelSpec, VisionModel


def _decode_fake(data: bytes, _config, _mode: str, max_image_pixels: int | None = None):
    """The fake family's CPU half: ``b"img:T,H,W[:seed]"`` -> its float32 patches as raw bytes."""
    from encoder_service.errors import InvalidInput
    from encoder_service.preprocess.staged import RawPatches

    if not data.startswith(b"img:"):
        raise InvalidInput("not a decodable image: format not recognised")
    parts = data[4:].decode().split(":")
    grid = tuple(int(x) for x in parts[0].split(","))
    seed = int(parts[1]) if len(parts) > 1 else 0
    return RawPatches(FakeVisionModel.patches(grid, seed).tobytes(), "float32", grid)


class FakeVisionModel(VisionModel):
    """A VisionModel whose forward is a fixed matrix: patch_dim 4, merge 2, hidden 8. Everything
    else (staging, validation, the pending result, the front end's view) is VisionModel's own.

    Each token is the mean of its 4 merged patches times a fixed matrix. ``gate`` (a
    threading.Event) lets a test hold the device worker inside a forward; ``batches`` records the
    grids of every forward. Encoded "images" are ``b"img:T,H,W[:seed]"``; other bytes are not images.
    With ``feature_levels`` > 1 each row also holds extra levels (as Qwen3-VL's deepstack does):
    level k is the main embedding times (k + 1) plus k, concatenated after it.
    """

    cache_namespace = "fake:ns"

    def __init__(self, feature_levels: int = 1) -> None:
        self.spec = ModelSpec(model_id="fake", model_type="fake", hidden_size=8, patch_size=2,
                              temporal_patch_size=1, spatial_merge_size=2, in_channels=1,
                              feature_levels=feature_levels)
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.attn_backend = "none"
        self.weight = torch.arange(32, dtype=torch.float32).reshape(4, 8) / 32.0
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a forward (not the warm-up) starts
        self.fail_forward = 0  # n > 0: the n-th forward (not counting warm-ups) raises
        self.batches: list[list[tuple[int, int, int]]] = []
        self.warmups = 0

    @staticmethod
    def patches(grid: Sequence[int], seed: int = 0) -> np.ndarray:
        n = int(np.prod(grid))
        return np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)

    def decoder(self) -> Decoder:
        return Decoder(_decode_fake, None, "pil")

    def warmup_inputs(self):
        from encoder_service.preprocess.staged import RawPatches

        return [[RawPatches(bytes(self.num_patches(g) * 4 * 4), "float32", g)] for g in ((1, 4, 4), (1, 8, 4))]

    def reference(self, pixel_values: np.ndarray) -> torch.Tensor:
        x = torch.as_tensor(np.asarray(pixel_values, dtype=np.float32))
        main = x.reshape(-1, 4, 4).mean(1) @ self.weight
        if self.spec.feature_levels == 1:
            return main
        return torch.cat([main * (k + 1) + k for k in range(self.spec.feature_levels)], dim=1)

    def encode_packed(self, pixel_values, grids):
        checked = self.validate(pixel_values, grids)
        # The worker's warm-up forwards are all-zero pixels (of two grid sizes).
        if float(torch.as_tensor(pixel_values).abs().sum()) == 0.0:
            self.warmups += 1
        else:
            self.batches.append([tuple(g) for g in checked])
            self.entered.set()
            self.gate.wait(30)
            if len(self.batches) == self.fail_forward:
                raise RuntimeError(f"forward {self.fail_forward} failed")
        return self.reference(torch.as_tensor(pixel_values).numpy()), tuple(self.num_tokens(g) for g in checked)
