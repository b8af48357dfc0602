"""The device worker: one thread that owns the model and runs every forward pass.

The event loop never calls the model. The worker takes a batch, runs ``validate`` and ``encode``
once for it, copies each embedding to the CPU (the one device sync per batch, at its end), and
hands the results back to the loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .batch_queue import BatchQueue, WorkItem

log = logging.getLogger(__name__)


@dataclass
class BatchOutcome:
    items: list[WorkItem]
    embeddings: list[torch.Tensor] | None  # CPU tensors with their own storage, one per item
    error: BaseException | None
    started_at: float  # perf_counter at the start of the forward
    forward_s: float


def _to_cpu_owned(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies that own their storage: a view would keep the whole batch's output alive."""
    if not outputs:
        return []
    if outputs[0].device.type == "cpu":
        return [o.detach().contiguous().clone() for o in outputs]
    # One device->host transfer for the batch rather than one per image.
    host = torch.cat([o.detach() for o in outputs]).to("cpu")
    return [part.clone() for part in torch.split(host, [int(o.shape[0]) for o in outputs])]


class DeviceWorker:
    def __init__(self, model, queue: BatchQueue, *, max_batch_patches: int, batch_wait_s: float,
                 loop: asyncio.AbstractEventLoop, on_batch_start: Callable[[list[WorkItem]], None],
                 on_batch_done: Callable[[BatchOutcome], None]) -> None:
        self._model = model
        self._queue = queue
        self._max_batch_patches = max_batch_patches
        self._batch_wait_s = batch_wait_s
        self._loop = loop
        self._on_batch_start = on_batch_start
        self._on_batch_done = on_batch_done
        self._thread = threading.Thread(target=self._run, name="device-worker", daemon=True)
        self._warmup: concurrent.futures.Future[float] = concurrent.futures.Future()

    def start(self, warmup_grid: tuple[int, int, int]) -> concurrent.futures.Future[float]:
        """Starts the thread; the returned future resolves (seconds) once the warm-up forward ran."""
        self._warmup_grid = warmup_grid
        self._thread.start()
        return self._warmup

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            self._warmup.set_result(self._run_warmup())
        except BaseException as exc:  # the server must not report SERVING with a broken model
            self._warmup.set_exception(exc)
            return
        while True:
            batch = self._queue.take_batch(self._max_batch_patches, self._batch_wait_s)
            if batch is None:
                return
            self._post(self._on_batch_start, batch)
            self._post(self._on_batch_done, self._forward(batch))

    def _run_warmup(self) -> float:
        t, h, w = self._warmup_grid
        pixels = torch.zeros(t * h * w, self._model.spec.patch_dim, dtype=torch.float32)
        started = time.perf_counter()
        with torch.inference_mode():
            _to_cpu_owned(self._model.encode(pixels, [self._warmup_grid]))
        return time.perf_counter() - started

    def _forward(self, batch: list[WorkItem]) -> BatchOutcome:
        started = time.perf_counter()
        try:
            pixels = np.concatenate([item.pixels for item in batch]) if len(batch) > 1 else batch[0].pixels
            pixel_values = torch.from_numpy(np.ascontiguousarray(pixels))
            grids = [list(item.grid) for item in batch]
            with torch.inference_mode():
                self._model.validate(pixel_values, grids)
                embeddings = _to_cpu_owned(self._model.encode(pixel_values, grids))
            if len(embeddings) != len(batch):
                raise RuntimeError(f"model returned {len(embeddings)} embeddings for {len(batch)} images")
            error = None
        except Exception as exc:  # reported to the waiting requests; the worker keeps serving
            log.exception("forward of a batch of %d images failed", len(batch))
            embeddings, error = None, exc
        return BatchOutcome(batch, embeddings, error, started, time.perf_counter() - started)

    def _post(self, fn: Callable, arg: object) -> None:
        # A closed loop (shutdown) leaves nobody to answer.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, arg)
