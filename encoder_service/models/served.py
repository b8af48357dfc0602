"""What the engine needs from a loaded model: the typed edge between engine/ and models/.

``VisionModel`` (models/base.py) satisfies it; so does any stand-in a test builds. The engine
names nothing else of a model, so a new family changes nothing on the engine's side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from ..preprocess.staged import StagedInput
from .base import ModelFront, ModelSpec


@runtime_checkable
class PendingBatch(Protocol):
    """A batch's embeddings on their way to host memory (``base.PendingEmbeddings``)."""

    def ready(self) -> bool:
        """Whether ``wait_packed`` would return at once; never blocks."""

    def wait_packed(self) -> torch.Tensor:
        """All images' rows in one CPU tensor [sum(num_tokens), spec.row_width]."""

    def wait(self) -> list[torch.Tensor]:
        """One CPU tensor per image."""

    def device_seconds(self) -> float | None:
        """The device's time for the batch, where it was timed (after a wait)."""

    def device_preprocess_seconds(self) -> float | None:
        """The part of it spent preprocessing on the device, where timed (after a wait)."""


@runtime_checkable
class ServedModel(Protocol):
    spec: ModelSpec
    device: torch.device
    attn_backend: str
    decode_backend: str  # where images decode: pillow (CPU) or nvjpeg (this device)
    # Forwards replayed as CUDA graphs at token budgets (models/cuda_graphs.py), or None.
    graphs: object | None

    def front(self) -> ModelFront:
        """The model as the serving front end sees it: facts and the CPU half of preprocessing."""

    def warmup_inputs(self) -> list[list[StagedInput]]:
        """Batches for the start-up forwards, through the same path as requests."""

    def encode_inputs_async(self, inputs: Sequence[StagedInput]) -> PendingBatch:
        """Enqueues a batch (device preprocessing and forward) without a host sync."""

    def set_cuda_graphs(self, budgets: Sequence[int]) -> None:
        """Forwards at these token budgets as CUDA graphs (none where empty or not on CUDA)."""

    def capture_cuda_graphs(self) -> object | None:
        """Captures them (start-up, after the warm-up); what it took, or None without graphs."""

    def set_decode(self, name: str) -> None:
        """``pillow`` or ``nvjpeg`` (JPEGs decode on the device); raises where it cannot run."""

    def set_video_decode(self, name: str) -> None:
        """``pyav`` or ``nvdec`` (clips' frames decode on a GPU); raises where it cannot run."""
