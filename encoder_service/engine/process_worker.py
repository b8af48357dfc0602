"""A device worker in its own process: one per device of ``--devices``.

The front end (event loop, image headers, hashing, cache, admission) stays in the server's process
and never initialises CUDA. Each ``WorkerProcess`` is a thread of the front end that pulls batches
from the shared ``BatchQueue`` whenever its worker has room (at most ``handoff.IN_FLIGHT`` batches in
flight: one on the device, the next launched behind it, a third decoding), so the least busy device
takes the next batch. It writes the batch's inputs into shared memory (JPEG and PNG files, which the
worker decodes: see preprocess/worker_decode.py; uint8 pixels the front end decoded; clips' frames;
client patch bytes), sends their layout over a pipe, and copies the embeddings back out of shared
memory when the worker answers (images the worker could not decode fail alone). Only CPU memory and
plain Python objects cross the boundary.

The child (worker_child.py), started with spawn, loads the model on its device (the only device it
can see: ``CUDA_VISIBLE_DEVICES`` is set to it, so no stray context lands on another GPU), runs
the warm-up, and then runs a loop like the in-process ``DeviceWorker``'s, one batch deeper.

A worker that dies (killed, CUDA error, out of memory) fails its batches in flight with
UNAVAILABLE (clients retry those) and is started again; the node serves on the other devices
meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle

from encoder_client.protocol.dtypes import BY_NAME

from ..config import BatchingConfig, LoadingConfig
from ..errors import Unavailable
from ..spawning import SPAWN_LOCK
from .batch_queue import BatchQueue, WorkItem
from .devices import WorkerDevice
from .handoff import ALIGN, IN_FLIGHT, SLOTS, copy_bytes, copy_out, describe
from .shared_buffer import SharedBuffer, grown
from .worker import BatchOutcome, BatchThread
from .worker_child import child_main

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
STOP_TIMEOUT_S = 10.0
LIVENESS_CHECK_S = 0.25  # an idle worker's death is noticed within this


class WorkerDied(Exception):
    pass


class WorkerProcess(BatchThread):
    """The front end's side of one worker process (a thread; see the module docstring)."""

    def __init__(self, loading: LoadingConfig, batching: BatchingConfig, device: WorkerDevice, queue: BatchQueue, *,
                 loop: asyncio.AbstractEventLoop, on_batch_start: Callable[[list[WorkItem]], None],
                 on_batch_done: Callable[[BatchOutcome], None],
                 on_state: Callable[[WorkerProcess], None], threads: int,
                 setup: Callable[[], None] | None = None) -> None:
        super().__init__(queue, loop=loop, on_batch_start=on_batch_start, on_batch_done=on_batch_done,
                         thread_name=f"worker-{device.label}")
        self.loading = loading  # all the worker process is sent (pickled at each spawn)
        self.batching = batching  # the batches this thread takes for it
        self.device = device
        self._on_state = on_state
        self._threads = threads
        self._setup = setup  # called in the worker process before it loads the model (tests only)
        self.up = False
        self.front = None  # the model's ModelFront, once the first start succeeded
        self.memory = (0, 0)  # device memory allocated / reserved, as the worker last reported it
        self._proc = None
        self._conn: Connection | None = None
        self._stopping = False
        self._in: list[SharedBuffer | None] = [None] * SLOTS
        self._out: list[SharedBuffer | None] = [None] * SLOTS
        self._seq = 0
        self._ready: concurrent.futures.Future[float] = concurrent.futures.Future()

    # --- life cycle (called from the loop) --------------------------------------------------------------
    def start(self) -> concurrent.futures.Future[float]:
        """Starts the worker; the future resolves (warm-up seconds) once its first warm-up ran, or
        fails with the reason it could not start."""
        self._thread.start()
        return self._ready

    def stop(self) -> None:
        """After ``BatchQueue.close``: the thread answers what is in flight and stops the worker.
        A worker still loading is killed (nothing of it is waited for)."""
        self._stopping = True
        if not self.up and self._proc is not None:
            with contextlib.suppress(Exception):
                self._proc.kill()

    # --- the thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        attempt = 0
        while not self._stopping:
            try:
                warmup_s = self._spawn()
            except Exception as exc:
                self._discard_process()
                if not self._ready.done():  # the first start: the server cannot come up like this
                    self._ready.set_exception(exc)
                    return
                delay = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
                attempt += 1
                log.error("worker on %s did not start again (%s); next try in %.1f s", self.device.label, exc, delay)
                time.sleep(delay)
                continue
            attempt = 0
            self._set_up(True)
            if not self._ready.done():
                self._ready.set_result(warmup_s)
            try:
                self._serve()
            except WorkerDied as exc:
                self._set_up(False)
                self._discard_process()
                if self._stopping:
                    return
                log.error("worker on %s died (%s); starting it again", self.device.label, exc)
                continue
            self._shutdown_process()
            self._set_up(False)
            return

    def _spawn(self) -> float:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=child_main, name=f"encoder-worker-{self.device.label}",
                           args=(child, self.loading, self.device.device, self.device.label, self._threads,
                                 self._setup),
                           daemon=True)
        with SPAWN_LOCK:  # CUDA_VISIBLE_DEVICES is set in our environment around the spawn
            saved = os.environ.get("CUDA_VISIBLE_DEVICES")
            if self.device.visible is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = self.device.visible
            try:
                proc.start()
            finally:
                if self.device.visible is not None:
                    if saved is None:
                        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = saved
        child.close()  # ours would keep the pipe open after the child died: no EOF would come
        self._proc, self._conn = proc, parent  # buffers: none yet (_discard_process emptied them)
        if self._stopping:
            raise WorkerDied("stopping")
        try:
            msg = parent.recv()
        except (EOFError, OSError) as exc:
            proc.join(1.0)
            raise WorkerDied(f"worker process exited with code {proc.exitcode} while loading") from exc
        if msg[0] == "failed":
            raise RuntimeError(f"worker on {self.device.label}: {msg[1]}")
        _, front, warmup_s = msg
        self.front = front
        log.info("worker on %s (pid %d): model %s, attention backend %s, ops %s, preprocess %s, dtype %s; "
                 "warm-up %.0f ms", self.device.label, proc.pid, front.spec.model_id, front.attention_backend,
                 front.ops, front.preprocess, front.dtype, warmup_s * 1000)
        return warmup_s

    def _serve(self) -> None:
        in_flight: deque[tuple[int, int, list[WorkItem], float]] = deque()
        answered = None  # a batch answered but not yet copied out of shared memory
        try:
            while True:
                batch = None
                if len(in_flight) < IN_FLIGHT:
                    idle = not in_flight and answered is None
                    batch = self._queue.take_batch(self.batching.max_batch_tokens, self.batching.batch_wait_s,
                                                   block=idle, idle_timeout_s=LIVENESS_CHECK_S)
                    if batch is None and idle:
                        return  # closed, and everything answered
                    if not batch and idle and not self._proc.is_alive():
                        raise EOFError("worker process gone while idle")
                    if batch:
                        self._post(self._on_batch_start, batch)
                        seq, self._seq = self._seq, self._seq + 1
                        in_flight.append((seq, seq % SLOTS, batch, time.perf_counter()))
                        self._send(seq, seq % SLOTS, batch)
                # The next batch went out first (above): the copy out of this one's embeddings
                # then overlaps the device's work instead of delaying it.
                if answered is not None:
                    self._deliver(*answered)
                    answered = None
                    continue
                # Full, or nothing new queued: wait for the oldest answer. (Polling the pipe and
                # the queue in turn would get new work out sooner, but this thread would then want
                # the front end's GIL thousands of times a second: measured slower on two GPUs.)
                if in_flight and (len(in_flight) == IN_FLIGHT or not batch):
                    msg = self._answer(in_flight[0])  # listed until answered: a death fails it too
                    entry = in_flight.popleft()
                    if msg is not None:
                        answered = (entry, msg)
        except (EOFError, OSError) as exc:
            code = self._exit_code()
            error = Unavailable(f"device worker {self.device.label} stopped (exit code {code}) during the "
                                "forward; retry")
            if answered is not None:  # answered, but its embeddings go with the buffers
                in_flight.appendleft(answered[0])
            for _, _, batch, started in in_flight:
                self._fail(batch, started, error)
            raise WorkerDied(f"exit code {code}") from exc

    def _send(self, seq: int, slot: int, batch: list[WorkItem]) -> None:
        layout, offset = [], 0
        for item in batch:
            payload = item.payload
            layout.append((offset, payload))
            offset += (payload.nbytes + ALIGN - 1) // ALIGN * ALIGN
        # Each image's embedding bytes: the worker packs those of the images it ran (with
        # --decode nvjpeg, a JPEG its device cannot decode is left out) and checks their sum.
        row_bytes = self.front.spec.row_width * BY_NAME[self.front.dtype].itemsize
        out_sizes = [self.front.num_tokens(item.grid) * row_bytes for item in batch]
        self._ensure(self._in, "in", slot, offset)
        self._ensure(self._out, "out", slot, sum(out_sizes))
        buffer = self._in[slot]
        described = []
        for start, payload in layout:
            copy_bytes(buffer.view(start, payload.nbytes), payload.host_bytes())
            described.append(describe(start, payload))
        self._conn.send(("batch", seq, slot, described, out_sizes))

    def _ensure(self, buffers: list[SharedBuffer | None], role: str, slot: int, needed: int) -> None:
        new = grown(buffers[slot], needed)
        if new is None:
            return
        old, buffers[slot] = buffers[slot], new
        self._conn.send(("buffer", role, slot, new.size))
        send_handle(self._conn, new.fd, self._proc.pid)
        if old is not None:
            old.close()

    def _answer(self, entry: tuple[int, int, list[WorkItem], float]) -> tuple | None:
        """The worker's answer to the oldest batch; a failed batch is reported here (None)."""
        seq, _, batch, started = entry
        msg = self._conn.recv()
        if msg[1] != seq:
            raise OSError(f"worker answered batch {msg[1]}, expected {seq}")
        if msg[0] == "error":
            self._fail(batch, started, msg[2])
            return None
        return msg

    def _deliver(self, entry: tuple[int, int, list[WorkItem], float], msg: tuple) -> None:
        _, slot, batch, started = entry
        _, _, forward_s, preprocess_s, self.memory, failed, decode_s = msg
        # Images the worker's device could not decode fail alone, as in-process (worker.py).
        rest = [item for index, item in enumerate(batch) if index not in failed]
        # Its output slot is written again only by the batch SLOTS after it: not yet sent.
        embeddings = copy_out(self._out[slot], rest, self.front) if rest else []
        self._post(self._on_batch_done, BatchOutcome(batch, embeddings, None, started, forward_s if rest else 0.0,
                                                     self.device.label, preprocess_s, failed, decode_s))

    def _fail(self, batch: list[WorkItem], started: float, error: BaseException) -> None:
        self._post(self._on_batch_done, BatchOutcome(batch, None, error, started, time.perf_counter() - started,
                                                     self.device.label))

    def _exit_code(self) -> int | None:
        if self._proc is None:
            return None
        self._proc.join(2.0)
        return self._proc.exitcode

    def _shutdown_process(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.send(("stop",))
        if self._proc is not None:
            self._proc.join(STOP_TIMEOUT_S)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(STOP_TIMEOUT_S)
        self._discard_process()

    def _discard_process(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(STOP_TIMEOUT_S)
        for buffers in (self._in, self._out):
            for i, buffer in enumerate(buffers):
                if buffer is not None:
                    buffer.close()
                    buffers[i] = None
        self._conn = None

    def _set_up(self, up: bool) -> None:
        self.up = up
        self._post(self._on_state, self)
