"""The devices an engine runs forwards on: one worker thread in this process (``--device``), or
one worker process per device (``--devices``). Either way they pull batches from the engine's
queue and hand outcomes back to its loop; the engine sees one interface."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import torch

from ..config import BatchingConfig, LoadingConfig, OnWorkers
from ..metrics import ServiceMetrics
from ..models.served import ServedModel
from .batch_queue import BatchQueue, WorkItem
from .devices import parse_devices
from .loading import load_model
from .process_worker import WorkerProcess
from .watchdog import DEAD, DOWN, UP
from .worker import BatchOutcome, DeviceWorker

BatchStart = Callable[[list[WorkItem], str], None]  # the batch, the label of the device it went to
BatchDone = Callable[[BatchOutcome], None]


class InProcessDevice:
    """The model in this process, driven by one ``DeviceWorker`` thread."""

    def __init__(self, loading: LoadingConfig, batching: BatchingConfig, metrics: ServiceMetrics,
                 model: ServedModel | None = None) -> None:
        self.loading = loading  # loads on loading.device (--device)
        self.batching = batching
        self.metrics = metrics
        self.model = model
        self._worker: DeviceWorker | None = None
        self._dead = False

    @property
    def label(self) -> str:
        return str(self.model.device)

    async def start(self, queue: BatchQueue, on_batch_start: BatchStart, on_batch_done: BatchDone,
                    on_serving: Callable[[bool], None]):
        """Loads the model if needed and runs its warm-up; returns (ModelFront, warm-up seconds)."""
        loop = asyncio.get_running_loop()
        if self.model is None:
            self.model = await loop.run_in_executor(None, load_model, self.loading)
        self._worker = DeviceWorker(
            self.model, queue, max_batch_patches=self.batching.max_batch_tokens,
            batch_wait_s=self.batching.batch_wait_s, loop=loop,
            on_batch_start=lambda batch: on_batch_start(batch, self.label), on_batch_done=on_batch_done)
        m = self.model.spec.spatial_merge_size
        warmup_s = await asyncio.wrap_future(self._worker.start((1, 2 * m, 2 * m)))
        self.metrics.workers_up.labels(device=self.label).set(1)
        return self.model.front(), warmup_s

    def states(self) -> dict[str, str]:
        """The worker thread ends only when the queue is closed; ended before that, an exception
        escaped its loop and nothing will take a batch again (no restart in-process)."""
        if not self._dead and self._worker is not None and not self._worker.alive:
            self._dead = True
            self.metrics.workers_up.labels(device=self.label).set(0)
        return {self.label: DEAD if self._dead else UP}

    async def stop(self) -> None:
        """After the queue closed: waits for the forward in flight."""
        if self._worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._worker.join)

    def memory_sources(self) -> dict[str, Callable[[], tuple[int, int]]]:
        device = self.model.device
        if device.type != "cuda":
            return {str(device): lambda: (0, 0)}
        return {str(device): lambda: (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))}


class WorkerProcesses:
    """One ``WorkerProcess`` per entry of ``--devices``; serving while any of them is up.
    ``setup``: a picklable function each worker process calls before it loads its model (tests)."""

    def __init__(self, placement: OnWorkers, loading: LoadingConfig, batching: BatchingConfig,
                 metrics: ServiceMetrics, setup: Callable[[], None] | None = None) -> None:
        self.placement = placement
        self.loading = loading  # sent to each worker process, and nothing more of the config
        self.batching = batching
        self.metrics = metrics
        self._setup = setup
        self.workers: list[WorkerProcess] = []
        self._on_serving: Callable[[bool], None] | None = None
        self._started = False
        self._stopping = False
        self._torch_threads: int | None = None  # the process's intra-op threads before start

    @property
    def label(self) -> str:
        return ",".join(w.device.label for w in self.workers)

    async def start(self, queue: BatchQueue, on_batch_start: BatchStart, on_batch_done: BatchDone,
                    on_serving: Callable[[bool], None]):
        """Starts every worker and waits for each one's warm-up; returns (ModelFront, the slowest
        warm-up). Fails, with every worker stopped, if one cannot start or they disagree."""
        loop = asyncio.get_running_loop()
        devices = parse_devices(self.placement.devices)
        threads = max(1, (os.cpu_count() or 1) // len(devices))
        # The front end's own torch work is copying bytes in and out of the hand-off buffers. With
        # torch's intra-op pool those copies woke OpenMP threads that then spin-wait: on one H100
        # the front end burned 123 ms of CPU an image that way, 9.9 with one thread (the cores the
        # decode threads and the event loop need). Restored at stop (engines in tests share a process).
        self._torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self._on_serving = on_serving
        self.workers = [
            WorkerProcess(self.loading, self.batching, device, queue, loop=loop,
                          on_batch_start=lambda batch, label=device.label: on_batch_start(batch, label),
                          on_batch_done=on_batch_done, on_state=self._on_worker_state, threads=threads,
                          setup=self._setup)
            for device in devices]
        results = await asyncio.gather(*(asyncio.wrap_future(w.start()) for w in self.workers),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            queue.close()
            await self.stop()
            raise failed[0]
        namespaces = {w.front.cache_namespace for w in self.workers}
        if len(namespaces) != 1:  # one cache for the node: every worker must compute the same embeddings
            queue.close()
            await self.stop()
            raise RuntimeError(f"workers disagree on the model (cache namespaces {sorted(namespaces)})")
        self._started = True
        return self.workers[0].front, max(results)

    async def stop(self) -> None:
        """After the queue closed: each worker answers what it has in flight and stops."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        for worker in self.workers:
            worker.stop()
        for worker in self.workers:
            await loop.run_in_executor(None, worker.join)
        if self._torch_threads is not None:
            torch.set_num_threads(self._torch_threads)
            self._torch_threads = None

    def memory_sources(self) -> dict[str, Callable[[], tuple[int, int]]]:
        """As each worker last reported it: the front end never touches a device."""
        return {w.device.label: (lambda w=w: w.memory) for w in self.workers}

    def states(self) -> dict[str, str]:
        """A worker's thread ends only when the engine stops; ended before that, an exception
        escaped it: its process may live on, but no batch will reach it again."""
        return {w.device.label: DEAD if not w.alive and not self._stopping else UP if w.up else DOWN
                for w in self.workers}

    def _on_worker_state(self, worker: WorkerProcess) -> None:
        self.metrics.workers_up.labels(device=worker.device.label).set(1 if worker.up else 0)
        if self._stopping or not self._started:
            return  # stopping, or still starting (the engine turns serving on after start)
        if not worker.up:
            self.metrics.worker_restarts.labels(device=worker.device.label).inc()
        self._on_serving(any(w.up for w in self.workers))
