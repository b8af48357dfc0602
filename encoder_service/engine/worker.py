"""The device worker: one thread that owns the model and runs every forward pass.

The event loop never calls the model. The worker takes a batch, runs ``encode_inputs_async`` once
for it (uint8 pixels or client patch bytes to the device, preprocessing and the forward there),
copies each embedding to the CPU (the one device sync per batch, at its end), and hands the results
back to the loop with ``call_soon_threadsafe``.

Two batches may be in flight: while the device computes one, the worker already stacks, validates
and enqueues the next (its metadata, its host-to-device copy), and only then waits for the first.
The device then never idles on the host between back-to-back batches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.served import PendingBatch, ServedModel
from ..preprocess.nvjpeg import UndecodableInputs
from .batch_queue import BatchQueue, WorkItem
from .warm_memory import HOST_COPIES

log = logging.getLogger(__name__)


@dataclass
class BatchOutcome:
    """A batch's one answer (the watchdog and the forward metrics count one per batch)."""

    items: list[WorkItem]
    # CPU tensors with their own storage, one per item not in item_errors, in order
    embeddings: list[torch.Tensor] | None
    error: BaseException | None  # the whole batch failed
    started_at: float  # perf_counter at the start of the forward
    forward_s: float  # the device's time for the batch (preprocessing + forward + copy back) where known
    device: str = ""  # the device that ran it (metrics label)
    preprocess_s: float | None = None  # the device's preprocessing part of forward_s where timed
    # Items that failed alone before the forward (a JPEG the device could not decode), by their
    # index in items: their batch mates ran without them.
    item_errors: dict[int, BaseException] = field(default_factory=dict)
    # The worker process's decode of the image files the front end handed on (preprocess/worker_decode.py):
    # wall seconds for the batch, before its forward.
    host_decode_s: float = 0.0

    @property
    def ran(self) -> list[WorkItem]:
        """The items that went through the forward (or were in it when the batch failed)."""
        return [item for i, item in enumerate(self.items) if i not in self.item_errors]


@dataclass
class _InFlight:
    batch: list[WorkItem]
    started: float
    pending: Any  # the model's PendingEmbeddings, of the batch's items not in failed
    failed: dict[int, BaseException]


def _owned(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies that own their storage: a view would keep the whole batch's (pinned) output alive.
    Into memory already mapped where one of the size is ready (engine/warm_memory.py)."""
    return HOST_COPIES.copies(parts)


def warm_up(model: ServedModel) -> float:
    """The start-up forwards (every shape a compiled model specialises on), then the capture of the
    CUDA graphs at their token budgets; returns their seconds."""
    started = time.perf_counter()
    for batch in model.warmup_inputs():
        model.encode_inputs_async(batch).wait()
    report = model.capture_cuda_graphs()
    if report is not None:
        log.info("CUDA graphs on %s: %d token budgets captured (%s patches) in %.1f s, holding %.0f MiB of GPU "
                 "memory%s", model.device, len(report.budgets), ",".join(map(str, report.budgets)), report.seconds,
                 report.memory_bytes / 2**20, f"; failed: {'; '.join(report.failed)}" if report.failed else "")
    return time.perf_counter() - started


class BatchThread:
    """What both kinds of device worker are to the front end (this module's ``DeviceWorker``, a
    ``WorkerProcess``'s thread): a daemon thread (``_run``) that takes batches from the shared queue
    and answers on the event loop, ``on_batch_start`` as a batch leaves and ``on_batch_done`` with its
    outcome."""

    def __init__(self, queue: BatchQueue, *, loop: asyncio.AbstractEventLoop,
                 on_batch_start: Callable[[list[WorkItem]], None], on_batch_done: Callable[[BatchOutcome], None],
                 thread_name: str) -> None:
        self._queue = queue
        self._loop = loop
        self._on_batch_start = on_batch_start
        self._on_batch_done = on_batch_done
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        """False once the thread ended: stopped (the queue closed), or an exception escaped it (the
        watchdog's concern)."""
        return self._thread.is_alive()

    def _post(self, fn: Callable, arg: object) -> None:
        post_to_loop(self._loop, fn, arg)


class DeviceWorker(BatchThread):
    def __init__(self, model: ServedModel, queue: BatchQueue, *, max_batch_patches: int, batch_wait_s: float,
                 loop: asyncio.AbstractEventLoop, on_batch_start: Callable[[list[WorkItem]], None],
                 on_batch_done: Callable[[BatchOutcome], None]) -> None:
        super().__init__(queue, loop=loop, on_batch_start=on_batch_start, on_batch_done=on_batch_done,
                         thread_name="device-worker")
        self._model = model
        self.label = str(model.device)
        self._max_batch_patches = max_batch_patches
        self._batch_wait_s = batch_wait_s
        self._warmup: concurrent.futures.Future[float] = concurrent.futures.Future()

    def start(self, warmup_grid: tuple[int, int, int]) -> concurrent.futures.Future[float]:
        """Starts the thread; the returned future resolves (seconds) once the warm-up forward ran."""
        self._warmup_grid = warmup_grid
        self._thread.start()
        return self._warmup

    def _run(self) -> None:
        try:
            self._warmup.set_result(self._run_warmup())
        except BaseException as exc:  # the server must not report SERVING with a broken model
            self._warmup.set_exception(exc)
            return
        in_flight: _InFlight | None = None
        while True:
            # With a batch on the device, take only what is already queued, so that waiting for more
            # work never delays the answer of the batch in flight.
            batch = self._queue.take_batch(self._max_batch_patches, self._batch_wait_s, block=in_flight is None)
            launched = None
            if batch:
                self._post(self._on_batch_start, batch)
                launched = self._launch(batch)
                if isinstance(launched, BatchOutcome):  # failed before reaching the device
                    self._post(self._on_batch_done, launched)
                    launched = None
            if in_flight is not None:
                self._post(self._on_batch_done, self._finish(in_flight))
            in_flight = launched
            if batch is None and in_flight is None:  # closed, nothing left to answer
                return

    def _run_warmup(self) -> float:
        return warm_up(self._model)

    def _launch(self, batch: list[WorkItem]) -> _InFlight | BatchOutcome | None:
        """Enqueues the batch's device work (preprocessing included) without waiting for it."""
        started = time.perf_counter()
        try:
            # H2D of uint8, preprocessing, forward and D2H into pinned memory are queued without a
            # host sync; wait() in _finish is the batch's single explicit wait.
            pending, failed = launch_decodable(self._model, [item.payload for item in batch])
        except Exception as exc:
            return self._failed(batch, started, exc)
        if pending is None:  # nothing in the batch could be decoded: no forward ran
            return BatchOutcome(batch, [], None, started, 0.0, self.label, item_errors=failed)
        return _InFlight(batch, started, pending, failed)

    def _finish(self, in_flight: _InFlight) -> BatchOutcome:
        batch, started, failed = in_flight.batch, in_flight.started, in_flight.failed
        try:
            embeddings = _owned(in_flight.pending.wait())
            if len(embeddings) != len(batch) - len(failed):
                raise RuntimeError(f"model returned {len(embeddings)} embeddings for {len(batch) - len(failed)} images")
        except Exception as exc:
            return self._failed(batch, started, exc, failed)
        # The device's own time where it has one: with two batches in flight, the wall time since
        # launch also counts the wait for the batch ahead.
        device_s = in_flight.pending.device_seconds()
        forward_s = device_s if device_s is not None else time.perf_counter() - started
        return BatchOutcome(batch, embeddings, None, started, forward_s, self.label,
                            in_flight.pending.device_preprocess_seconds(), failed)

    def _failed(self, batch: list[WorkItem], started: float, exc: Exception,
                item_errors: dict[int, BaseException] | None = None) -> BatchOutcome:
        # Reported to the waiting requests; the worker keeps serving.
        log.error("forward of a batch of %d images failed", len(batch), exc_info=exc)
        return BatchOutcome(batch, None, exc, started, time.perf_counter() - started, self.label,
                            item_errors=dict(item_errors or {}))


def launch_decodable(model: ServedModel, inputs: list) -> tuple[PendingBatch | None, dict[int, Exception]]:
    """``encode_inputs_async`` of the inputs the device can decode: the batch of the others in
    flight (None if none is left), and the error of each input it could not decode by its index in
    ``inputs``. With --decode nvjpeg a JPEG the device rejects must fail alone, not its batch mates;
    the in-process worker and a worker process (worker_child.py) both launch through here."""
    failed: dict[int, Exception] = {}
    indices = list(range(len(inputs)))
    while indices:
        try:
            return model.encode_inputs_async([inputs[i] for i in indices]), failed
        except UndecodableInputs as exc:
            if not exc.errors:
                raise
            for position, error in exc.errors.items():
                log.warning("image %d of a batch could not be decoded on the device: %s", indices[position], error)
                failed[indices[position]] = error
            indices = [index for position, index in enumerate(indices) if position not in exc.errors]
    return None, failed


def post_to_loop(loop: asyncio.AbstractEventLoop, fn: Callable, arg: object) -> None:
    """``fn(arg)`` on the event loop, from a worker's thread; a closed loop (shutdown) leaves
    nobody to answer."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, arg)
