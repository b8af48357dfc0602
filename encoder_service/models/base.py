"""What every loaded vision model offers the engine: the public Python API of the README.

``load_vision_model`` returns a ``VisionModel``. The engine calls only what is here; model families
implement ``_forward`` (the torch module) and their preprocessing.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..attention import AUTO, RaggedOnly, graph_backend, select_backend
from ..device import host_to_device
from ..errors import BackendUnavailable
from ..modality import Modality
from ..ops import OpsSelection, OpTarget, no_ops, parse_ops, select_ops
from ..preprocess import nvjpeg
from ..preprocess.batch import batch_pixel_values
from ..preprocess.decoders import IMAGE_DEFAULT, image_decoder, video_decoder
from ..preprocess.staged import DecodedImage, RawPatches, StagedInput, resolve_mode
from .cuda_graphs import BudgetGraphs, CaptureReport, GraphForward, Slots

# Re-exported: the families and the engine import them from here.
from .spec import Grid, ModelSpec, validate_batch, validate_grid  # noqa: F401
from .video_hooks import VideoFront, VideoHooks

# --quantization methods beside "none".
QUANTIZATIONS = ("fp8",)


@dataclass(frozen=True)
class Decoder:
    """The CPU half of a family's preprocessing, bound to its settings: picklable (a module-level
    function and a config dataclass), so a front end without the model can decode for it."""

    function: Callable[..., DecodedImage]  # (bytes, config, mode, max_image_pixels) -> DecodedImage
    config: object
    mode: str
    # (height, width, config) -> (resize_to, pad_to, grid): the sizes ``function`` works out, for a
    # decoder that reads only the header (--decode nvjpeg).
    geometry: nvjpeg.Geometry | None = None

    def __call__(self, image_bytes: bytes, max_image_pixels: int | None = None) -> DecodedImage:
        return self.function(image_bytes, self.config, self.mode, max_image_pixels)


@dataclass(frozen=True)
class ModelFront:
    """What the serving front end needs of a model, without its weights or its device: facts to
    plan and report with, and the CPU half of preprocessing. A worker process that owns the model
    sends this to the front end (plain CPU objects only: the front end never touches a device).

    Its facts carry the names they have on the wire (``ModelInfo``, GetModelInfo's answer): the
    engine reports them by name (``Engine.describe``), so a new reported fact is a field here (or in
    ``ModelSpec``) and its field in ``ModelInfo`` and the proto, nothing in between."""

    spec: ModelSpec
    dtype: str  # "bfloat16", ...
    device: str
    attention_backend: str
    preprocess: str  # "pil" or "torch" (VisionModel.preprocess_mode)
    cache_namespace: str
    decoder: Decoder | nvjpeg.NvjpegDecoder
    ops: str = "none"  # OpsSelection.describe(): the fused operations' providers
    decode: str = IMAGE_DEFAULT  # where images decode: "pillow" (CPU) or "nvjpeg" (GPU), preprocess/decoders.py
    video_front: VideoFront | None = None  # the family's video path (None: it takes no video)
    quantization: str = "none"  # --quantization: "none" or "fp8" (VisionModel.quantize)

    def decode_image(self, image_bytes: bytes, max_image_pixels: int | None = None) -> DecodedImage:
        return self.decoder(image_bytes, max_image_pixels)

    def num_patches(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return int(t) * int(h) * int(w)

    def num_tokens(self, grid: Sequence[int]) -> int:
        return self.spec.num_tokens(grid)


class VisionModel(VideoHooks):
    """A loaded vision tower with its preprocessing. Subclasses set ``module`` and ``spec``."""

    spec: ModelSpec
    module: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    attn_backend: str
    # The fused operations the family's module runs (encoder_service/ops) and their providers, chosen
    # at load time (none for a model built without VisionModel.__init__, as test stand-ins are).
    OPS: tuple[str, ...] = ()
    # The fused operations its --quantization fp8 forward asks for besides (or instead of) OPS.
    FP8_OPS: tuple[str, ...] = ()
    ops: OpsSelection = no_ops()
    # pil: resize on the CPU, bit-exact with transformers' PIL processor; torch: resize on the
    # model's device, equal to its default torchvision-backed processor (preprocess/staged.py).
    preprocess_mode: str = "pil"
    # pillow: images decode on the CPU; nvjpeg: JPEGs decode on the GPU (preprocess/nvjpeg.py). The names
    # and what each needs: preprocess/decoders.py.
    decode_backend: str = IMAGE_DEFAULT
    _tables: dict[tuple[torch.device, torch.dtype, Modality], torch.Tensor] | None = None  # value tables by device
    # --quantization: None (the checkpoint's dtype throughout) or "fp8" (the blocks' linears in e4m3,
    # ops/fp8.py), set by ``quantize`` after loading.
    quantization: str | None = None

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
        self._ops_spec, self._attention_named = ops, attn_backend != AUTO
        self.ops = select_ops(ops, self._ops_target(), self.OPS, attention_named=attn_backend != AUTO,
                              later=self.FP8_OPS)

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
        if not image_decoder(self.decode_backend).default:  # other pixels; Pillow's namespace stays what it was
            payload["decode"] = self.decode_backend
        if not video_decoder(self.video_decode).default:  # other frames; PyAV's namespace stays what it was
            payload["video_decode"] = self.video_decode
        if self.quantization:  # other embeddings; an unquantised model's namespace stays what it was
            payload["quantization"] = self.quantization
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
        return f"{self.spec.model_type}:{digest[:24]}"

    # --- the public API ----------------------------------------------------------------------
    def quantize(self, method: str | None) -> None:
        """``--quantization``: None or ``none`` keeps the checkpoint's dtype; ``fp8`` runs the blocks'
        linears in e4m3 (per-channel weight scales, per-token activation scales: ops/fp8.py). Once,
        after loading and before CUDA graphs are captured. Raises, naming the reason, where the
        family or the device cannot."""
        if method in (None, "", "none"):
            if fp8_named := [c for c in parse_ops(self._ops_spec)[1] if c in self.FP8_OPS]:
                raise BackendUnavailable(f"--ops names {', '.join(fp8_named)}, which runs only with "
                                         "--quantization fp8")
            return
        if self.graphs is not None:
            raise BackendUnavailable("quantize the model before its CUDA graphs are set (set_cuda_graphs)")
        if method not in QUANTIZATIONS:
            raise BackendUnavailable(f"--quantization {method!r}: unknown; methods: none, {', '.join(QUANTIZATIONS)}")
        if self.quantization is not None:
            raise BackendUnavailable(f"the model is already quantised ({self.quantization})")
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise BackendUnavailable(f"--quantization fp8 needs FP8 GEMMs (compute capability 8.9 or newer); "
                                     f"{torch.cuda.get_device_name(self.device)} has "
                                     f"{'.'.join(map(str, torch.cuda.get_device_capability(self.device)))}")
        if self.device.type == "cuda" and self.dtype != torch.bfloat16:
            # torch's FP8 GEMMs with per-token scales write bf16 only.
            raise BackendUnavailable(f"--quantization fp8 on a GPU needs --dtype bfloat16, not "
                                     f"{str(self.dtype).removeprefix('torch.')}")
        self._quantize_fp8()
        self.quantization = method

    def _quantize_fp8(self) -> None:
        """The family's FP8 weights and the providers of its FP8 operations."""
        raise BackendUnavailable(f"--quantization fp8 is not supported for {self.spec.model_type}")

    def set_preprocess_mode(self, mode: str) -> None:
        """``auto`` (torch on an accelerator, pil on the CPU), ``pil`` or ``torch``."""
        mode = resolve_mode(mode, self.device)
        self._check_preprocess_mode(mode)
        self.preprocess_mode = mode
        self._tables = None

    def set_decode(self, name: str) -> None:
        """``pillow`` (the default) or ``nvjpeg``: JPEGs decode on this CUDA device, in ``torch``
        preprocessing only (the resize must run after the device decode)."""
        image_decoder(name).require(self.device, self.preprocess_mode)
        self.decode_backend = name

    def decode(self, image_bytes: bytes, max_image_pixels: int | None = None) -> DecodedImage:
        """The CPU half of preprocessing: bytes -> uint8 pixels, target size and grid (a JPEG's
        bytes and sizes with --decode nvjpeg)."""
        return self._front_decoder()(image_bytes, max_image_pixels)

    def _front_decoder(self) -> Decoder | nvjpeg.NvjpegDecoder:
        return image_decoder(self.decode_backend).front(self.decoder())

    def decoder(self) -> Decoder:
        """The family's decode function bound to this model's preprocessing settings and mode."""
        raise NotImplementedError

    def front(self) -> ModelFront:
        """This model as the serving front end sees it (see ``ModelFront``)."""
        return ModelFront(self.spec, dtype=str(self.dtype).removeprefix("torch."), device=str(self.device),
                          attention_backend=str(self.attn_backend), preprocess=self.preprocess_mode,
                          cache_namespace=self.cache_namespace, decoder=self._front_decoder(), ops=self.ops.describe(),
                          decode=self.decode_backend, video_front=self.video_front(),
                          quantization=self.quantization or "none")

    def _check_preprocess_mode(self, mode: str) -> None:
        """Raises where the family's config cannot be reproduced in ``mode``."""

    def _value_table(self) -> torch.Tensor:
        """float32 [3, 256] on the CPU: rescale + normalize of each byte (preprocess/staged.py)."""
        raise NotImplementedError

    def _patchify(self, image: torch.Tensor) -> torch.Tensor:
        """[C, H, W] normalized image -> [num_patches, patch_dim] in the model's patch order."""
        raise NotImplementedError

    def _table(self, device: torch.device, dtype: torch.dtype, modality: Modality = "image") -> torch.Tensor:
        if self._tables is None:
            self._tables = {}
        if (device, dtype, modality) not in self._tables:  # once per device and dtype, at warm-up: not in a forward
            self._tables[(device, dtype, "image")] = self._value_table().to(dtype).to(device)
            if (clip := self._clip_value_table()) is not None:
                self._tables[(device, dtype, "video")] = clip.to(dtype).to(device)
        return self._tables[(device, dtype, modality)]

    def pixel_values(self, inputs: Sequence[StagedInput], device: torch.device | None = None,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
        """The device half of preprocessing for a batch: [sum(patches), patch_dim] on ``device`` in
        ``dtype`` (the model's by default). One host-to-device copy of uint8 (or the client's patch
        bytes; JPEGs with ``--decode nvjpeg`` decode there), then resize / pad / normalize /
        patchify there; never waits on the device, except for nvJPEG's own decode."""
        device = self.device if device is None else device
        dtype = self.dtype if dtype is None else dtype
        return batch_pixel_values(inputs, device, dtype, mode=self.preprocess_mode, patch_dim=self.spec.patch_dim,
                                  table=lambda: self._table(device, dtype), patchify=self._patchify,
                                  clip_table=lambda: self._table(device, dtype, "video"),
                                  patchify_clip=self._patchify_clip)

    def warmup_inputs(self) -> list[list[StagedInput]]:
        """Batches for the start-up forwards, through the same path as requests: two token counts
        (a compiled model specialises on the first and recompiles once with a dynamic token
        dimension on the second; both belong to start-up, not to a first request), images whose
        sides need a resize, and client patches. With --decode nvjpeg the second image is a JPEG, so
        nvJPEG's first call (its handles, its buffers) is start-up work too."""
        factor = self.spec.patch_size * self.spec.spatial_merge_size
        rng = np.random.default_rng(0)
        images = []
        formats = ("PNG", "JPEG" if image_decoder(self.decode_backend).on_device else "PNG")
        for (height, width), fmt in zip(((2 * factor + 3, 2 * factor + 5), (2 * factor + 3, 4 * factor + 5)), formats):
            buffer = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, fmt)
            images.append(self.decode(buffer.getvalue()))
        grid = images[0].grid
        zeros = bytes(self.num_patches(grid) * self.spec.patch_dim * 4)
        return [[images[0]], [images[1]], [RawPatches(zeros, "float32", grid), images[0]]]

    def preprocess(self, image_bytes: bytes, max_image_pixels: int | None = None
                   ) -> tuple[np.ndarray, Grid]:
        """Encoded image bytes -> (patches [t*h*w, patch_dim] float32, (t, h, w)), both halves on
        the CPU in the model's preprocess mode."""
        item = self.decode(image_bytes, max_image_pixels)
        pixels = self.pixel_values([item], torch.device("cpu"), torch.float32)
        return pixels.numpy(), item.grid  # host: both halves on the CPU, never on the model's device

    def validate(self, pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]]) -> list[Grid]:
        return validate_batch(pixel_values, grids, self.spec)

    # Forwards replayed as CUDA graphs at token budgets (models/cuda_graphs.py); None where the
    # model runs every forward eagerly.
    graphs: BudgetGraphs | None = None

    def graph_forward(self, backend: RaggedOnly) -> GraphForward | None:
        """The family's forward split for CUDA graphs, attending with ``backend`` (None: the family
        runs every forward eagerly)."""
        return None

    def set_cuda_graphs(self, budgets: Sequence[int], slots: Slots | None = None) -> None:
        """Forwards at these token budgets (patches) as CUDA graphs, captured by
        ``capture_cuda_graphs``, their attention patterns holding ``slots`` (default: ``Slots()``).
        None where the budgets are empty, the model is not on a CUDA device, no backend with static
        plans runs here, or the family has no graph forward."""
        self.graphs = None
        backend = graph_backend(self.backend) if budgets and self.device.type == "cuda" else None
        forward = self.graph_forward(backend) if backend is not None else None
        if forward is not None:
            self.graphs = BudgetGraphs(forward, budgets, patch_dim=self.spec.patch_dim, device=self.device,
                                       dtype=self.dtype, slots=slots)

    def capture_cuda_graphs(self) -> CaptureReport | None:
        """Captures the budgets' graphs (start-up, after the warm-up forwards); None without graphs."""
        return None if self.graphs is None else self.graphs.capture()

    def _replayed(self, pixels: torch.Tensor, grids: Sequence[Grid], tokens: tuple[int, ...]
                  ) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        """``encode_packed``'s answer from a graph, or None (the batch runs eagerly)."""
        if self.graphs is None:
            return None
        out = self.graphs.run(pixels, grids, sum(tokens))
        return None if out is None else (out, tokens)

    def _encode_grids(self, pixel_values: torch.Tensor | np.ndarray, grids: Sequence[Sequence[int]],
                      metadata: Callable[[list[Grid]], Any]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """``encode_packed`` of a family whose module runs a batch as ``module(pixels, meta, backend)``,
        ``meta = metadata(checked grids)`` telling each image's rows (``meta.tokens_per_image``, one per
        merged patch): replayed from a CUDA graph where one holds the batch, else eagerly."""
        checked = self.validate(pixel_values, grids)
        x = self._pixels_to_device(pixel_values).to(self.dtype)
        replayed = self._replayed(x, checked, tuple(self.num_tokens(g) for g in checked))
        if replayed is not None:
            return replayed
        meta = metadata(checked)
        return self.module(x, meta, self.backend), meta.tokens_per_image

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
            pixel_values = self.pixel_values(inputs)
        preprocessed = self._start_event()  # where the device's preprocessing ends and the forward begins
        packed, tokens = self.encode_packed(pixel_values, [list(item.grid) for item in inputs])
        return PendingEmbeddings.to_host(packed, tokens, started, preprocessed)

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
                 started: torch.cuda.Event | None = None, preprocessed: torch.cuda.Event | None = None) -> None:
        self._host = host
        self._tokens = tokens
        self._done = done
        self._started = started
        self._preprocessed = preprocessed

    @classmethod
    def to_host(cls, packed: torch.Tensor, tokens: tuple[int, ...], started: torch.cuda.Event | None,
                preprocessed: torch.cuda.Event | None = None) -> PendingEmbeddings:
        """Queues the copy of a device result into pinned host memory (no wait)."""
        if packed.device.type == "cpu":
            return cls(packed, tokens, None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        done = torch.cuda.Event(enable_timing=started is not None)
        done.record()
        return cls(host, tokens, done, started, preprocessed)

    def device_seconds(self) -> float | None:
        """The device's time from the batch's start to its copy back (after ``wait``), if timed."""
        if self._started is None or self._done is None:
            return None
        return self._started.elapsed_time(self._done) / 1000.0

    def device_preprocess_seconds(self) -> float | None:
        """The part of ``device_seconds`` spent preprocessing on the device (decode, resize,
        normalize, patchify) before the forward, if timed (after ``wait``)."""
        if self._started is None or self._preprocessed is None:
            return None
        return self._started.elapsed_time(self._preprocessed) / 1000.0

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
