"""Forwards replayed as CUDA graphs at a ladder of token budgets, captured at start-up.

Why: an eager forward of one image is launch-bound. Qwen2.5-VL-7B's forward is ~230 kernels, and
for a 448x448 image the device idles between them: 20 ms eager, 4.7 ms replayed (bench/RESULTS.md).

How (as vLLM's encoder graphs): a ladder of budgets, each a patch count. A batch of N patches runs in
the graph of the smallest budget B >= N that holds it:

* its grids get one filler image of B - N patches at the end (``filler_grid``), so every per-patch
  tensor of the forward has B rows;
* every attention pattern is padded to a fixed number of sequences (zero-length ones at the end) and
  a fixed longest sequence (``encoder_service.metadata.pad_attention``; the family says which
  pattern gets which), so every plan has the shape it had at capture;
* the batch's metadata and plans are prepared as for an eager forward (host-to-device copies, device
  work such as a position table's resampling) and copied into the graph's own buffers
  (``copy_into``), its pixels into the graph's input buffer; the graph replays; the real images'
  rows, which come first, are copied out.
* the prepared metadata of the last few batch shapes stays on the device (``PREPARED_KEPT``): it
  depends on the grids and the budget alone, so a batch of a shape seen lately (a lone 448x448
  image after another) skips building it on the host and copying it over, and only its
  device-to-device copies into the graph's buffers remain. That host work was about a third of the
  worker's launch of a lone image.

Why the filler changes no real image: attention stays within a sequence, and the filler is its own
sequence(s); every other step is per patch or per merged token (norms, projections, MLPs, rotary,
position embeddings, the merger), and the output keeps the images in order. What can differ is
rounding: a GEMM over B rows instead of N may pick another cuBLAS kernel. tests/gpu/test_gpu.py holds
each family's replays to its eager forward within a stated bf16 bound.

A batch that fits no budget (more patches than the top, more sequences than a budget holds, a
shape the family's padding cannot fix, such as Kimi-K2.5's pooling over a clip's frames) runs
eagerly, as does every batch of a backend whose plans are not tensors (``static_plans``).

Memory: the graphs are captured from the largest budget down into one shared memory pool (they
never run at once: one device worker replays them in stream order), so the ladder holds about the
largest budget's activations, plus each budget's input buffer and prepared metadata.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..metadata import bucket_batch_size

log = logging.getLogger(__name__)

Grid = tuple[int, int, int]

# Batch shapes whose prepared metadata stays on the device, and the device bytes they may hold
# together (most families' metadata is tens to hundreds of KiB; Kimi-K2.5's holds the batch's
# resampled position embedding, 14 MiB at 6144 patches in bf16).
PREPARED_KEPT = 16
PREPARED_BYTES = 64 << 20

# The ladder's bottom: a 224x224 image is 256 patches; smaller batches are padded up to it.
LADDER_BOTTOM = 256
# The default ladder's top (patches), chosen by measurement through a real server (bench/RESULTS.md,
# 2026-11-28, Qwen2.5-VL-7B on one H100, FlashInfer's cuDNN attention, bf16, a lone 1008x1008 JPEG,
# which the processor resizes to 4900 patches): with the ladder up to 6144 its p50 was 34.9 and 39.3 ms
# against 39.2 and 44.6 ms up to 4096 (two runs, two machines; the device's forward 16.3 / 16.4 ms
# replayed against 19.5 / 21.8 ms eager). Alone, the eager forward of that image is faster than its
# replay (14.7 against 16.7 ms): in the server, other threads delay the eager forward's launches and
# not a replay's. Above 6144 (two 1008x1008 images and up) replays lost alone by a third and more
# (2 x 1008x1008 at 16384: 49.5 against 30.2 ms). Batches above the top run eagerly.
DEFAULT_TOP = 6144
QUARTER_STEPS_FROM = 4096


class NotStatic(Exception):
    """A batch whose prepared metadata does not fit a graph's buffers: it runs eagerly."""


def ladder(top: int, bottom: int = LADDER_BOTTOM) -> tuple[int, ...]:
    """Budgets from ``bottom`` up to ``top``: the powers of two and 1.5 times each (256, 384, 512,
    768, ...), so that padding adds at most half a batch (a third past 512); from 4096 patches on,
    where a step is milliseconds of forward, quarter steps too (4096, 5120, 6144, 7168, 8192: a
    1008x1008 image's 4900 patches pad to 5120); and ``top`` itself."""
    out = set()
    power = bottom
    while power <= top:
        steps = (4, 5, 6, 7) if power >= QUARTER_STEPS_FROM else (4, 6)
        out.update(b for b in (power * k // 4 for k in steps) if b <= top)
        power *= 2
    if top >= bottom:
        out.add(top)
    return tuple(sorted(out))


def resolve_budgets(asked: tuple[int, ...] | None, max_batch_patches: int, unit: int) -> tuple[int, ...]:
    """``--cuda-graphs`` for a model: None (auto) is the ladder up to the smaller of DEFAULT_TOP and
    the largest batch; budgets asked for must be multiples of ``unit`` (the merge unit), from
    LADDER_BOTTOM up to the largest batch. ValueError otherwise."""
    if asked is None:
        return ladder(_round_down(min(DEFAULT_TOP, max_batch_patches), unit))
    for budget in asked:
        if budget < LADDER_BOTTOM or budget % unit or budget > max_batch_patches:
            raise ValueError(f"cuda-graphs budget {budget}: each must be a multiple of {unit} patches (the merge "
                             f"unit), at least {LADDER_BOTTOM} and at most --max-batch-tokens {max_batch_patches}")
    return tuple(sorted(asked))


def _round_down(n: int, unit: int) -> int:
    return n // unit * unit


def filler_grid(patches: int, merge: int) -> Grid:
    """One frame of ``patches`` patches (a multiple of merge**2) as near square as its factors
    allow: a legal grid for every family (sides multiples of the merge size)."""
    blocks = patches // (merge * merge)
    assert blocks * merge * merge == patches and blocks > 0, (patches, merge)
    side = max(d for d in range(1, math.isqrt(blocks) + 1) if blocks % d == 0)
    return (1, side * merge, blocks // side * merge)


@dataclass(frozen=True)
class Slots:
    """How many sequences each attention pattern of a budget's graph holds.

    Why few: a padded pattern is launched at its capacity whatever the batch, and the attention
    kernels (cuDNN's) launch work for every sequence slot up to the pattern's longest length, so an
    empty slot costs. With one window slot per merged token (256 at 1024 patches, 1024 at 3072), a lone
    448x448 image of Qwen2.5-VL-7B replayed in 5.7 ms and a 672x672 one in 16.2 ms, against 4.4 and
    9.2 ms with the default here (bench/RESULTS.md, 2026-11-28). A batch with more sequences than a
    budget holds goes to a larger budget, or runs eagerly.

    Capacities are powers of two: the kernels pad the sequence count to one (``bucket_batch_size``).
    """

    # Full attention (one sequence per image or frame): one slot per ``full_patches`` patches of the
    # budget (a 224x224 image is 256), at least ``full_min`` and at most ``full_max``, plus the filler.
    full_patches: int = 256
    full_min: int = 16
    full_max: int = 1 << 20
    # Windowed attention (Qwen2.5-VL): the windows the budget holds when its images tile into whole
    # windows, times ``window_factor`` for images whose sides leave partial windows, plus one per full
    # slot; None: one window per merged token, the most any batch can have (measured: the class docstring).
    window_factor: float | None = 2.0

    def full(self, budget: int) -> int:
        return bucket_batch_size(min(self.full_max, max(self.full_min, budget // self.full_patches)) + 1)

    def windows(self, budget: int, window_tokens: int, merge_unit: int) -> int:
        if self.window_factor is None:
            return bucket_batch_size(budget // merge_unit)
        return bucket_batch_size(math.ceil(self.window_factor * budget / window_tokens) + self.full(budget))


def copy_into(static: Any, fresh: Any) -> None:
    """Refreshes a graph's prepared metadata in place from a new batch's: each tensor copied into
    the graph's (same shape and dtype), every other value equal. Raises NotStatic otherwise."""
    if isinstance(static, torch.Tensor):
        if not isinstance(fresh, torch.Tensor) or fresh.shape != static.shape or fresh.dtype != static.dtype:
            raise NotStatic(f"a tensor {tuple(static.shape)} {static.dtype} gets "
                            f"{getattr(fresh, 'shape', type(fresh).__name__)}")
        static.copy_(fresh, non_blocking=True)
    elif dataclasses.is_dataclass(static) and not isinstance(static, type):
        if type(fresh) is not type(static):
            raise NotStatic(f"{type(static).__name__} gets {type(fresh).__name__}")
        for f in dataclasses.fields(static):
            copy_into(getattr(static, f.name), getattr(fresh, f.name))
    elif isinstance(static, (tuple, list)):
        if type(fresh) is not type(static) or len(fresh) != len(static):
            raise NotStatic(f"a sequence of {len(static)} gets {type(fresh).__name__}")
        for a, b in zip(static, fresh):
            copy_into(a, b)
    elif isinstance(static, dict):
        if not isinstance(fresh, dict) or fresh.keys() != static.keys():
            raise NotStatic("a dict gets other keys")
        for key, value in static.items():
            copy_into(value, fresh[key])
    elif static is not fresh and static != fresh:  # ints, sizes: baked into the captured launches
        raise NotStatic(f"{static!r} gets {fresh!r}")


def own_tensors(value: Any) -> Any:
    """``value`` (tensors in dataclasses, sequences, dicts, as ``copy_into`` walks them) with every
    tensor a copy of its own."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: own_tensors(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, (tuple, list)):
        return type(value)(own_tensors(v) for v in value)
    if isinstance(value, dict):
        return {k: own_tensors(v) for k, v in value.items()}
    return value


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (walked as ``own_tensors`` walks it)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(tensor_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, (tuple, list)):
        return sum(map(tensor_bytes, value))
    if isinstance(value, dict):
        return sum(map(tensor_bytes, value.values()))
    return 0


@dataclass(frozen=True)
class GraphForward:
    """A family's forward split for graphs. ``metadata``, ``pad`` and ``prepare`` run eagerly before
    each replay; only ``run`` is captured."""

    metadata: Callable[[list[Grid]], Any]  # host metadata of a batch's grids
    pad: Callable[[Any, int, Slots], Any]  # that metadata with every attention pattern at the budget's fixed shape
    prepare: Callable[[Any], Any]  # host-to-device copies, plans, grid-dependent device work
    run: Callable[[torch.Tensor, Any], torch.Tensor]  # device work only, on prepared metadata
    merge: int  # spatial merge size: the filler's sides are multiples of it


@dataclass
class _Graph:
    budget: int
    pixels: torch.Tensor  # the input buffer the graph reads
    prepared: Any  # the metadata and plans it reads
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None  # the output buffer it writes


@dataclass(frozen=True)
class CaptureReport:
    budgets: tuple[int, ...]
    seconds: float
    memory_bytes: int  # device memory the ladder holds (pool, buffers), measured around the capture
    failed: tuple[str, ...] = ()


class BudgetGraphs:
    """The graphs of one model at its ladder of budgets (see the module docstring)."""

    def __init__(self, forward: GraphForward, budgets: Sequence[int], *, patch_dim: int,
                 device: torch.device, dtype: torch.dtype, slots: Slots | None = None) -> None:
        self.forward = forward
        self.slots = slots or Slots()
        self.budgets = tuple(sorted(budgets))
        self.patch_dim = patch_dim
        self.device = device
        self.dtype = dtype
        self._graphs: dict[int, _Graph] = {}
        # (budget, grids) -> their prepared metadata, never written once made (a copy source only)
        self._prepared: OrderedDict[tuple, Any] = OrderedDict()
        self.replays = 0
        self.eager = 0  # batches that fit no captured budget
        self.report: CaptureReport | None = None  # what the capture took, once done

    def __len__(self) -> int:
        return len(self._graphs)

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def _padded(self, grids: Sequence[Grid], patches: int, budget: int) -> Any:
        padded = list(grids)
        if budget > patches:
            padded.append(filler_grid(budget - patches, self.forward.merge))
        return self.forward.pad(self.forward.metadata(padded), budget, self.slots)

    def _prepared_for(self, grids: Sequence[Grid], patches: int, budget: int) -> tuple[tuple, Any, bool]:
        """(key, the batch's padded metadata prepared on the device, whether it was kept already)."""
        key = (budget, tuple(tuple(int(x) for x in grid) for grid in grids))
        fresh = self._prepared.get(key)
        if fresh is not None:
            self._prepared.move_to_end(key)
            return key, fresh, True
        return key, self.forward.prepare(self._padded(grids, patches, budget)), False

    def _keep(self, key: tuple, fresh: Any) -> None:
        """Keeps a batch's metadata that served a replay (one that cannot is never kept), within
        ``PREPARED_KEPT`` shapes and ``PREPARED_BYTES``, the least recently used going first."""
        if tensor_bytes(fresh) > PREPARED_BYTES:
            return  # larger than the whole bound: kept, it would only push the others out
        self._prepared[key] = fresh
        while len(self._prepared) > PREPARED_KEPT or sum(map(tensor_bytes, self._prepared.values())) > PREPARED_BYTES:
            self._prepared.popitem(last=False)

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Captures every budget, the largest first, into one memory pool. A budget whose capture
        fails is dropped (logged): its batches go to a larger budget or run eagerly."""
        started = time.perf_counter()
        # The device's free memory with the caching allocator emptied before and after: torch.cuda.graph
        # empties the cache itself, which returned the warm-up's blocks mid-measurement (the reserve
        # read -276 MiB across a capture).
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        failed = []
        for budget in sorted(self.budgets, reverse=True):
            try:
                entry = self._static(budget)
                # Outside the capture first: kernels compile, libraries build their plans and graphs.
                self.forward.run(entry.pixels, entry.prepared)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                # thread_local: other threads of the server (request handlers pinning host memory)
                # may keep making CUDA calls while this one captures.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    entry.out = self.forward.run(entry.pixels, entry.prepared)
                entry.graph = graph
                self._graphs[budget] = entry
            except Exception as exc:  # a kernel that cannot be captured at this budget
                log.warning("CUDA graph capture at %d patches failed; that budget runs eagerly: %s: %s",
                            budget, type(exc).__name__, exc)
                failed.append(f"{budget}: {type(exc).__name__}: {exc}")
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.report = CaptureReport(self.captured, time.perf_counter() - started,
                                    before - torch.cuda.mem_get_info(self.device)[0], tuple(failed))
        return self.report

    def static_buffers(self) -> None:
        """Every budget's buffers without a capture: ``run`` then runs the forward eagerly on them,
        so the padding and the buffers' refresh can be exercised where graphs cannot (the CPU)."""
        for budget in self.budgets:
            self._graphs[budget] = self._static(budget)

    def _static(self, budget: int) -> _Graph:
        pixels = torch.zeros(budget, self.patch_dim, dtype=self.dtype, device=self.device)
        # Copies of their own: every batch's metadata is copied into these buffers, and a family's
        # prepare may hand back a view of the model's state (Kimi-K2.5's position table, as it is at a
        # grid of the table's own size), which those copies would overwrite.
        prepared = own_tensors(self.forward.prepare(self._padded([], 0, budget)))
        return _Graph(budget, pixels, prepared)

    def run(self, pixels: torch.Tensor, grids: Sequence[Grid], rows: int) -> torch.Tensor | None:
        """The batch's ``rows`` output rows from the smallest captured budget that holds it, or None
        (run it eagerly). ``pixels``: [patches, patch_dim] on the device in the model's dtype."""
        patches = int(pixels.shape[0])
        for budget in self.budgets:
            entry = self._graphs.get(budget)
            if budget < patches or entry is None:
                continue
            try:
                key, fresh, kept = self._prepared_for(grids, patches, budget)
                if entry.graph is not None:
                    copy_into(entry.prepared, fresh)
            except (NotStatic, ValueError):  # more sequences than this budget holds: a larger one may
                continue
            if not kept:
                self._keep(key, fresh)
            entry.pixels[:patches].copy_(pixels)
            if entry.graph is not None:
                entry.graph.replay()
                out = entry.out
            else:  # static_buffers(): the padded forward, eagerly, on the prepared metadata as it came
                out = self.forward.run(entry.pixels, fresh)
            self.replays += 1
            # A fresh tensor: the buffer is overwritten by the next replay, and callers keep this one.
            return out[:rows].clone()
        self.eager += 1
        return None
