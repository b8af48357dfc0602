"""What every loaded vision model offers the engine: the public Python API of the README.

``load_vision_model`` returns a ``VisionModel``. The engine calls only what is here; model families
implement ``_forward`` (the torch module) and their preprocessing.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from ..attention import AUTO, select_backend
from ..device import host_to_device
from ..errors import InvalidInput
from ..ops import OpsSelection, OpTarget, no_ops, select_ops
from ..preprocess.staged import (
    DecodedImage,
    RawPatches,
    StagedInput,
    apply_table,
    image_tensor,
    patches_from_bytes,
    resolve_mode,
    stage_to_device,
)

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class ModelSpec:
    """Static facts about a loaded model that the API reports and the engine plans with."""

    model_id: str
    model_type: str
    hidden_size: int  # output (LLM) hidden size of each embedding row
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    # Feature levels per embedding row: the main embedding, then any extra levels the LLM injects
    # elsewhere (Qwen3-VL's deepstack), each ``hidden_size`` wide and concatenated along the row.
    feature_levels: int = 1
    # Whether the merger folds a clip's frames into one set of tokens (Kimi-K2.5 averages them), so
    # that tokens do not grow with t.
    frames_merged: bool = False
    # Fingerprint inputs for cache_namespace: anything that changes the embedding of the same bytes.
    fingerprint: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size * self.spatial_merge_size

    def num_tokens(self, grid: Sequence[int]) -> int:
        """Embedding rows of one image of ``grid`` [t, h, w] (in patches)."""
        t, h, w = (int(v) for v in grid)
        return (1 if self.frames_merged else t) * h * w // self.merge_unit

    @property
    def row_width(self) -> int:
        """Values in one embedding row: ``hidden_size`` for each feature level."""
        return self.hidden_size * self.feature_levels


def validate_grid(grid: Sequence[int], spec: ModelSpec) -> Grid:
    """Checks one [t, h, w] grid (Python ints) against the model's merge rules."""
    if isinstance(grid, (str, bytes)) or len(grid) != 3:
        raise InvalidInput(f"grid_thw must be [t, h, w], got {list(grid) if not isinstance(grid, str) else grid!r}")
    try:
        t, h, w = (int(x) for x in grid)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"grid_thw must hold integers, got {list(grid)!r}") from exc
    if t < 1:
        raise InvalidInput(f"grid t must be >= 1, got t={t}")
    m = spec.spatial_merge_size
    if h < m or w < m or h % m or w % m:
        raise InvalidInput(
            f"grid h and w must be positive multiples of the spatial merge size {m}, got h={h}, w={w}"
        )
    return t, h, w


def validate_batch(pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]],
                   spec: ModelSpec) -> list[Grid]:
    """Checks a batch before any device work: grids legal, patch count and width matching."""
    if len(grids) == 0:
        raise InvalidInput("empty batch: no images (grid_thw is empty)")
    checked = []
    for i, g in enumerate(grids):
        try:
            checked.append(validate_grid(g, spec))
        except InvalidInput as exc:
            raise exc.with_image(i) from None
    if pixel_values.ndim != 2:
        raise InvalidInput(f"pixel_values must be 2-D [patches, {spec.patch_dim}], got shape "
                           f"{tuple(pixel_values.shape)}")
    if pixel_values.shape[1] != spec.patch_dim:
        raise InvalidInput(f"wrong patch width: pixel_values has {pixel_values.shape[1]} values per patch, "
                           f"the model needs {spec.patch_dim}")
    expected = sum(t * h * w for t, h, w in checked)
    if pixel_values.shape[0] != expected:
        raise InvalidInput(f"patch count does not match the grids: pixel_values has {pixel_values.shape[0]} "
                           f"patches, grids {[list(g) for g in checked]} need {expected}")
    return checked


@dataclass(frozen=True)
class Decoder:
    """The CPU half of a family's preprocessing, bound to its settings: picklable (a module-level
    function and a config dataclass), so a front end without the model can decode for it."""

    function: Callable[..., DecodedImage]  # (bytes, config, mode, max_image_pixels) -> DecodedImage
    config: object
    mode: str

    def __call__(self, image_bytes: bytes, max_image_pixels: int | None = None) -> DecodedImage:
        return self.function(image_bytes, self.config, self.mode, max_image_pixels)


@dataclass(frozen=True)
class ModelFront:
    """What the serving front end needs of a model, without its weights or its device: facts to
    plan and report with, and the CPU half of preprocessing. A worker process that owns the model
    sends this to the front end (plain CPU objects only: the front end never touches a device)."""

    spec: ModelSpec
    dtype: str  # "bfloat16", ...
    device: str
    attn_backend: str
    preprocess_mode: str
    cache_namespace: str
    decoder: Decoder
    ops: str = "none"  # OpsSelection.describe(): the fused operations' providers

    def decode(self, image_bytes: bytes, max_image_pixels: int | None = None) -> DecodedImage:
        return self.decoder(image_bytes, max_image_pixels)

    def num_patches(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return int(t) * int(h) * int(w)

    def num_tokens(self, grid: Sequence[int]) -> int:
        return self.spec.num_tokens(grid)


class VisionModel:
    """A loaded vision tower with its preprocessing. Subclasses set ``module`` and ``spec``."""

    spec: ModelSpec
    module: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    attn_backend: str
    # The fused operations the family's module runs (encoder_service/ops) and their providers, chosen
    # at load time (none for a model built without VisionModel.__init__, as test stand-ins are).
    OPS: tuple[str, ...] = ()
    ops: OpsSelection = no_ops()
    # pil: resize on the CPU, bit-exact with transformers' PIL processor; torch: resize on the
    # model's device, equal to its default torchvision-backed processor (preprocess/staged.py).
    preprocess_mode: str = "pil"
    _tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] | None = None  # value tables by device

    def __init__(self, cfg, module: torch.nn.Module, *, device: torch.device, dtype: torch.dtype,
                 attn_backend: str, ops: str = AUTO) -> None:
        """What every family's model binds: its config (with ``num_heads`` and ``head_dim``), the module,
        where it runs, the attention backend and its ``OPS``' providers (``--ops``), selected here once
        (fails here, with the reason). Families set ``preprocess_config`` and ``spec`` around it."""
        self.cfg = cfg
        self.module = module
        self.device = device
        self.dtype = dtype
        self._attach_backend(attn_backend, cfg.num_heads, cfg.head_dim)
        self.ops = select_ops(ops, self._ops_target(), self.OPS, attention_named=attn_backend != AUTO)

    def _ops_target(self) -> OpTarget | None:
        """The facts the providers of ``OPS`` are chosen by (None: the family uses no fused operations)."""

    # --- sizes -------------------------------------------------------------------------------
    def num_patches(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return int(t) * int(h) * int(w)

    def num_tokens(self, grid: Sequence[int]) -> int:
        return self.spec.num_tokens(grid)

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    @property
    def patch_dim(self) -> int:
        return self.spec.patch_dim

    @property
    def cache_namespace(self) -> str:
        """Fingerprint of everything that changes an embedding besides the input bytes."""
        payload = {
            "model_id": self.spec.model_id,
            "model_type": self.spec.model_type,
            "dtype": str(self.dtype).removeprefix("torch."),
            "preprocess_mode": self.preprocess_mode,
            **self.spec.fingerprint,
        }
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
        return f"{self.spec.model_type}:{digest[:24]}"

    # --- the public API ----------------------------------------------------------------------
    def set_preprocess_mode(self, mode: str) -> None:
        """``auto`` (torch on an accelerator, pil on the CPU), ``pil`` or ``torch``."""
        mode = resolve_mode(mode, self.device)
        self._check_preprocess_mode(mode)
        self.preprocess_mode = mode
        self._tables = None

    def decode(self, image_bytes: bytes, max_image_pixels: int | None = None) -> DecodedImage:
        """The CPU half of preprocessing: bytes -> uint8 pixels, target size and grid."""
        return self.decoder()(image_bytes, max_image_pixels)

    def decoder(self) -> Decoder:
        """The family's decode function bound to this model's preprocessing settings and mode."""
        raise NotImplementedError

    def front(self) -> ModelFront:
        """This model as the serving front end sees it (see ``ModelFront``)."""
        return ModelFront(self.spec, str(self.dtype).removeprefix("torch."), str(self.device), str(self.attn_backend),
                          self.preprocess_mode, self.cache_namespace, self.decoder(), self.ops.describe())

    def _check_preprocess_mode(self, mode: str) -> None:
        """Raises where the family's config cannot be reproduced in ``mode``."""

    def _value_table(self) -> torch.Tensor:
        """float32 [3, 256] on the CPU: rescale + normalize of each byte (preprocess/staged.py)."""
        raise NotImplementedError

    def _patchify(self, image: torch.Tensor) -> torch.Tensor:
        """[C, H, W] normalized image -> [num_patches, patch_dim] in the model's patch order."""
        raise NotImplementedError

    def _table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        if self._tables is None:
            self._tables = {}
        key = (device, dtype)
        if key not in self._tables:  # once per device and dtype, at warm-up: not in a forward's path
            self._tables[key] = self._value_table().to(dtype).to(device)
        return self._tables[key]

    def stage(self, inputs: Sequence[StagedInput], device: torch.device | None = None,
              dtype: torch.dtype | None = None) -> torch.Tensor:
        """The device half of preprocessing for a batch: [sum(patches), patch_dim] on ``device`` in
        ``dtype`` (the model's by default). One host-to-device copy of uint8 (or the client's patch
        bytes), then resize / pad / normalize / patchify there; never waits on the device."""
        device = self.device if device is None else device
        dtype = self.dtype if dtype is None else dtype
        parts = []
        for raw, item in zip(stage_to_device(list(inputs), device), inputs):
            if isinstance(item, RawPatches):
                parts.append(patches_from_bytes(raw, item, self.spec.patch_dim, dtype))
            else:
                image = image_tensor(raw, item, self.preprocess_mode)
                parts.append(self._patchify(apply_table(image, self._table(device, dtype))))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def warmup_inputs(self) -> list[list[StagedInput]]:
        """Batches for the start-up forwards, through the same path as requests: two token counts
        (a compiled model specialises on the first and recompiles once with a dynamic token
        dimension on the second; both belong to start-up, not to a first request), images whose
        sides need a resize, and client patches."""
        factor = self.spec.patch_size * self.spec.spatial_merge_size
        rng = np.random.default_rng(0)
        images = []
        for height, width in ((2 * factor + 3, 2 * factor + 5), (2 * factor + 3, 4 * factor + 5)):
            buffer = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, "PNG")
            images.append(self.decode(buffer.getvalue()))
        grid = images[0].grid
        zeros = bytes(self.num_patches(grid) * self.spec.patch_dim * 4)
        return [[images[0]], [images[1]], [RawPatches(zeros, "float32", grid), images[0]]]

    def preprocess(self, image_bytes: bytes, max_image_pixels: int | None = None
                   ) -> tuple[np.ndarray, Grid]:
        """Encoded image bytes -> (patches [t*h*w, patch_dim] float32, (t, h, w)), both halves on
        the CPU in the model's preprocess mode."""
        item = self.decode(image_bytes, max_image_pixels)
        pixels = self.stage([item], torch.device("cpu"), torch.float32)
        return pixels.numpy(), item.grid  # host: staged on the CPU, never on the model's device

    def validate(self, pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]]) -> list[Grid]:
        return validate_batch(pixel_values, grids, self.spec)

    # Batch compositions replayed as CUDA graphs (models/cuda_graphs.py); None where the model
    # runs every forward eagerly.
    graphs = None

    def set_cuda_graphs(self, capacity: int) -> None:
        """Keep up to ``capacity`` batch compositions as CUDA graphs (0: none). Models without graph
        support run eagerly whatever the capacity."""

    def _attach_backend(self, name: str, num_heads: int, head_dim: int) -> None:
        """Selects the attention backend once, at load time (fails there, with the reason)."""
        backend_cls = select_backend(name, self.device, self.dtype, head_dim)
        self.attn_backend = backend_cls.name
        self.backend = backend_cls(num_heads, head_dim, self.device, self.dtype)

    def _pixels_to_device(self, pixel_values: torch.Tensor | np.ndarray) -> torch.Tensor:
        """One asynchronous host-to-device copy (from pinned memory) of a batch's pixels."""
        if isinstance(pixel_values, np.ndarray):
            return host_to_device(pixel_values, self.device)
        if pixel_values.device.type == "cpu" and self.device.type != "cpu":
            return pixel_values.pin_memory().to(self.device, non_blocking=True)
        return pixel_values.to(self.device)

    def encode_packed(self, pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]]
                      ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The forward of one batch: all images' embeddings in one [sum(tokens), hidden] tensor on the
        model's device, and the token count of each image. Enqueues device work; never waits on it."""
        raise NotImplementedError

    def encode(self, pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]]
               ) -> list[torch.Tensor]:
        """Patches of several images (concatenated) -> one [num_tokens_i, hidden] tensor per image.

        Returned tensors live on the model's device in the model's dtype.
        """
        packed, tokens = self.encode_packed(pixel_values, grids)
        return list(packed.split(tokens))

    def _start_event(self) -> torch.cuda.Event | None:
        """A timing event recorded on the stream now (CUDA only): the batch's device time starts here."""
        if self.device.type != "cuda":
            return None
        started = torch.cuda.Event(enable_timing=True)
        started.record()
        return started

    def encode_inputs_async(self, inputs: Sequence[StagedInput]) -> PendingEmbeddings:
        """``encode_async`` of staged inputs (decoded images, client patches): preprocessing runs
        on the device in the same stream, before the forward; still no host sync."""
        started = self._start_event()
        with torch.inference_mode():
            pixel_values = self.stage(inputs)
        packed, tokens = self.encode_packed(pixel_values, [list(item.grid) for item in inputs])
        return PendingEmbeddings.to_host(packed, tokens, started)

    def encode_async(self, pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]]
                     ) -> PendingEmbeddings:
        """Enqueues the whole batch (H2D, forward, D2H into pinned host memory) without one host
        sync; ``.wait()`` on the result is the batch's single explicit wait."""
        started = self._start_event()
        packed, tokens = self.encode_packed(pixel_values, grids)
        return PendingEmbeddings.to_host(packed, tokens, started)


class PendingEmbeddings:
    """Embeddings of a batch on their way to host memory."""

    def __init__(self, host: torch.Tensor, tokens: tuple[int, ...], done: torch.cuda.Event | None,
                 started: torch.cuda.Event | None = None) -> None:
        self._host = host
        self._tokens = tokens
        self._done = done
        self._started = started

    @classmethod
    def to_host(cls, packed: torch.Tensor, tokens: tuple[int, ...],
                started: torch.cuda.Event | None) -> PendingEmbeddings:
        """Queues the copy of a device result into pinned host memory (no wait)."""
        if packed.device.type == "cpu":
            return cls(packed, tokens, None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        done = torch.cuda.Event(enable_timing=started is not None)
        done.record()
        return cls(host, tokens, done, started)

    def device_seconds(self) -> float | None:
        """The device's time from the batch's start to its copy back (after ``wait``), if timed."""
        if self._started is None or self._done is None:
            return None
        return self._started.elapsed_time(self._done) / 1000.0

    def ready(self) -> bool:
        """Whether ``wait`` would return at once (the copy back has landed); never blocks."""
        return self._done is None or self._done.query()

    def wait_packed(self) -> torch.Tensor:
        """All images' embeddings in one CPU tensor [sum(num_tokens), hidden], once the copy has landed."""
        if self._done is not None:
            self._done.synchronize()
        return self._host

    def wait(self) -> list[torch.Tensor]:
        """One CPU tensor [num_tokens_i, hidden] per image, once the copy has landed."""
        return list(self.wait_packed().split(self._tokens))
