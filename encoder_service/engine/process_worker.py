"""A device worker in its own process: one per device of ``--devices``.

The front end (event loop, decode, hashing, cache, admission) stays in the server's process and
never initialises CUDA. Each ``WorkerProcess`` is a thread of the front end that pulls batches from
the shared ``BatchQueue`` whenever its worker has room (at most two batches in flight, one on the
device and the next one staged), so the least busy device takes the next batch. It writes the
batch's uint8 pixels (or client patch bytes) into shared memory, sends their layout over a pipe,
and copies the embeddings back out of shared memory when the worker answers. Only CPU memory and
plain Python objects cross the boundary.

The child (``_child_main``), started with spawn, loads the model on its device (the only device it
can see: ``CUDA_VISIBLE_DEVICES`` is set to it, so no stray context lands on another GPU), runs
the warm-up, and then runs the same two-in-flight loop as the in-process ``DeviceWorker``.

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
import signal
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle

from ..config import ServiceConfig
from ..errors import Unavailable
from .batch_queue import BatchQueue, WorkItem
from .convert import ITEMSIZE, torch_dtype
from .shared_buffer import SharedBuffer, grown
from .worker import BatchOutcome

log = logging.getLogger(__name__)

IN_FLIGHT = 2  # one batch on the device, the next staged behind it
SLOTS = IN_FLIGHT + 1  # shared buffers each way: one more for the batch being copied out
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
STOP_TIMEOUT_S = 10.0
LIVENESS_CHECK_S = 0.25  # an idle worker's death is noticed within this
POLL_S = 0.0005  # while one batch runs: how often the worker looks for the next batch
_ALIGN = 64
_SPAWN_LOCK = threading.Lock()  # CUDA_VISIBLE_DEVICES is set in our environment around each spawn


@dataclass(frozen=True)
class WorkerDevice:
    """One entry of ``--devices``: the device the worker reports (``label``, e.g. cuda:1), the
    device its model uses inside its process, and the CUDA_VISIBLE_DEVICES it gets (None: keep)."""

    label: str
    device: str
    visible: str | None

    @classmethod
    def parse(cls, entry: str, position: int = 0) -> WorkerDevice:
        entry = entry.strip()
        if entry == "cpu":  # CPU workers are told apart by their place in --devices
            return cls(f"cpu:{position}", "cpu", None)
        index = entry.removeprefix("cuda:")
        if not index.isdigit():
            raise ValueError(f"--devices entry {entry!r} is neither cpu nor a GPU index (0, 1 or cuda:1)")
        parent = os.environ.get("CUDA_VISIBLE_DEVICES")
        # Indices count the GPUs this process may see, as torch's do.
        visible = index if parent is None else _nth_visible(parent, int(index))
        return cls(f"cuda:{index}", "cuda:0", visible)


def parse_devices(spec: str) -> list[WorkerDevice]:
    """``--devices``: ``0,1``, ``cuda:0,cuda:1``, ``cpu,cpu`` or ``all`` (every GPU this process
    may see, counted through NVML: asking the CUDA runtime would initialise it here)."""
    if spec.strip() == "all":
        import torch

        count = torch.cuda._device_count_nvml()
        if count <= 0:
            raise ValueError("--devices all: no GPU visible (NVML found none)")
        entries = [str(i) for i in range(count)]
    else:
        entries = [e for e in spec.split(",") if e.strip()]
    devices = [WorkerDevice.parse(e, i) for i, e in enumerate(entries)]
    if not devices:
        raise ValueError(f"--devices {spec!r} names no device")
    labels = [d.label for d in devices]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--devices {spec!r} names a GPU twice")
    if len({d.device.split(":")[0] for d in devices}) != 1:
        raise ValueError(f"--devices {spec!r} mixes CPU and GPU workers: one node computes one kind of embedding")
    return devices


def _nth_visible(visible: str, index: int) -> str:
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        raise ValueError(f"--devices names GPU {index}, but CUDA_VISIBLE_DEVICES={visible!r} shows "
                         f"{len(entries)} GPU(s)")
    return entries[index]


class WorkerDied(Exception):
    pass


class WorkerProcess:
    """The front end's side of one worker process (a thread; see the module docstring)."""

    def __init__(self, config: ServiceConfig, device: WorkerDevice, queue: BatchQueue, *,
                 loop: asyncio.AbstractEventLoop, on_batch_start: Callable[[list[WorkItem]], None],
                 on_batch_done: Callable[[BatchOutcome], None],
                 on_state: Callable[[WorkerProcess], None], threads: int) -> None:
        self.config = config
        self.device = device
        self._queue = queue
        self._loop = loop
        self._on_batch_start = on_batch_start
        self._on_batch_done = on_batch_done
        self._on_state = on_state
        self._threads = threads
        self.up = False
        self.restarts = 0
        self.front = None  # the model's ModelFront, once the first start succeeded
        self.memory = (0, 0)  # device memory allocated / reserved, as the worker last reported it
        self.pid: int | None = None
        self._proc = None
        self._conn: Connection | None = None
        self._stopping = False
        self._in: list[SharedBuffer | None] = [None] * SLOTS
        self._out: list[SharedBuffer | None] = [None] * SLOTS
        self._seq = 0
        self._ready: concurrent.futures.Future[float] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, name=f"worker-{device.label}", daemon=True)

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

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def kill(self) -> None:
        """SIGKILL the worker process (tests, and nothing else)."""
        if self._proc is not None:
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
                self.restarts += 1
                log.error("worker on %s died (%s); starting it again", self.device.label, exc)
                continue
            self._shutdown_process()
            self._set_up(False)
            return

    def _spawn(self) -> float:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_child_main, name=f"encoder-worker-{self.device.label}",
                           args=(child, self.config, self.device.device, self.device.label, self._threads),
                           daemon=True)
        with _SPAWN_LOCK:
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
        self._proc, self._conn, self.pid = proc, parent, proc.pid
        self._in = [None] * SLOTS
        self._out = [None] * SLOTS
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
        log.info("worker on %s (pid %d): model %s, attention backend %s, preprocess %s, dtype %s; warm-up %.0f ms",
                 self.device.label, proc.pid, front.spec.model_id, front.attn_backend, front.preprocess_mode,
                 front.dtype, warmup_s * 1000)
        return warmup_s

    def _serve(self) -> None:
        in_flight: deque[tuple[int, int, list[WorkItem], float]] = deque()
        answered = None  # a batch answered but not yet copied out of shared memory
        try:
            while True:
                batch = None
                if len(in_flight) < IN_FLIGHT:
                    idle = not in_flight and answered is None
                    batch = self._queue.take_batch(self.config.max_batch_tokens, self.config.batch_wait_ms / 1000.0,
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
            for _, _, batch, started in in_flight:
                self._post(self._on_batch_done, BatchOutcome(batch, None, error, started,
                                                             time.perf_counter() - started, self.device.label))
            raise WorkerDied(f"exit code {code}") from exc

    def _send(self, seq: int, slot: int, batch: list[WorkItem]) -> None:
        layout, offset = [], 0
        for item in batch:
            payload = item.payload
            layout.append((offset, payload))
            offset += (payload.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        out_bytes = sum(self.front.num_tokens(item.grid) for item in batch) * self.front.spec.hidden_size \
            * ITEMSIZE[self.front.dtype]
        self._ensure(self._in, "in", slot, offset)
        self._ensure(self._out, "out", slot, out_bytes)
        buffer = self._in[slot]
        described = []
        for start, payload in layout:
            _copy_bytes(buffer.view(start, payload.nbytes), payload.host_bytes())
            described.append(_describe(start, payload))
        self._conn.send(("batch", seq, slot, described, out_bytes))

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
            self._post(self._on_batch_done, BatchOutcome(batch, None, msg[2], started,
                                                         time.perf_counter() - started, self.device.label))
            return None
        return msg

    def _deliver(self, entry: tuple[int, int, list[WorkItem], float], msg: tuple) -> None:
        _, slot, batch, started = entry
        _, _, forward_s, self.memory = msg
        # Its output slot is written again only by the batch three after it: not yet sent.
        embeddings = _copy_out(self._out[slot], batch, self.front)
        self._post(self._on_batch_done, BatchOutcome(batch, embeddings, None, started, forward_s, self.device.label))

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

    def _post(self, fn: Callable, arg: object) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop (shutdown) leaves nobody to answer
            self._loop.call_soon_threadsafe(fn, arg)


def _copy_bytes(dst, src) -> None:
    """dst[:] = src for uint8 arrays, through torch, which copies without holding the GIL (numpy
    holds it: megabytes per image would stall the event loop)."""
    import torch

    if not len(src):
        return
    with warnings.catch_warnings():  # a read-only source (request bytes) is only read here
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(src)
    torch.from_numpy(dst).copy_(source)


def _describe(offset: int, payload) -> tuple:
    from ..preprocess.staged import DecodedImage

    if isinstance(payload, DecodedImage):
        return ("image", offset, payload.nbytes, payload.pixels.shape, payload.resize_to, payload.pad_to,
                payload.grid)
    return ("patches", offset, payload.nbytes, payload.dtype, payload.grid)


def _copy_out(buffer: SharedBuffer, batch: list[WorkItem], front) -> list:
    """Each image's embedding, copied out of shared memory into a tensor of its own (the cache
    keeps it; the buffer is reused by the batch after next). torch copies without the GIL."""
    import torch

    dtype = torch_dtype(front.dtype)
    hidden = front.spec.hidden_size
    tokens = [front.num_tokens(item.grid) for item in batch]
    total = sum(tokens) * hidden
    packed = torch.frombuffer(buffer.array, dtype=dtype, count=total).view(-1, hidden)
    return [part.clone() for part in packed.split(tokens)]


# --- the child process -------------------------------------------------------------------------------------
def _child_main(conn: Connection, config: ServiceConfig, device: str, label: str, threads: int) -> None:
    # Stops come from the front end over the pipe (or its end closing): a Ctrl-C or a SIGTERM sent
    # to the whole process group must not kill a worker in the middle of the drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=config.log_level,
                        format=f"%(asctime)s %(levelname)s [worker {label}] %(name)s: %(message)s")
    try:
        import torch

        if device == "cpu":
            torch.set_num_threads(max(1, threads))
        from .loading import load_model
        from .worker import warm_up

        model = load_model(config, device)
        warmup_s = warm_up(model)
    except Exception as exc:
        logging.getLogger(__name__).exception("could not load and warm up the model on %s", label)
        with contextlib.suppress(Exception):
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", model.front(), warmup_s))
    _ChildLoop(conn, model).run()
    # Interpreter teardown would only make the cuDNN frontend's nanobind module print hundreds of
    # "leaked instance" lines (its objects live in module caches): everything is answered, leave.
    logging.shutdown()
    os._exit(0)


class _ChildLoop:
    def __init__(self, conn: Connection, model) -> None:
        self.conn = conn
        self.model = model
        self.buffers: dict[tuple[str, int], SharedBuffer] = {}

    def _next_message(self, pending: deque) -> tuple | None:
        """The next message, or None when the oldest batch in flight should be answered now.

        With one batch on the device, waits for whichever comes first: the next batch (launched at
        once, so the device never idles between the two) or the end of the one running."""
        if not pending:
            return self.conn.recv()
        while len(pending) < IN_FLIGHT:
            if self.conn.poll(POLL_S):
                return self.conn.recv()
            if pending[0][3].ready():
                return None
        return None

    def run(self) -> None:
        pending: deque[tuple[int, int, int, object]] = deque()
        while True:
            try:
                msg = self._next_message(pending)
            except (EOFError, OSError):
                return  # the front end is gone: nobody to answer
            if msg is not None and msg[0] == "stop":
                while pending:
                    self._finish(pending.popleft())
                return
            if msg is not None and msg[0] == "buffer":
                _, role, slot, size = msg
                old = self.buffers.pop((role, slot), None)
                if old is not None:
                    old.close()
                self.buffers[(role, slot)] = SharedBuffer.attach(recv_handle(self.conn), size)
                continue
            if msg is not None:
                launched = self._launch(msg)
                if launched is not None:
                    pending.append(launched)
            if pending and (msg is None or len(pending) >= IN_FLIGHT):
                self._finish(pending.popleft())

    def _launch(self, msg: tuple):
        _, seq, slot, described, out_bytes = msg
        try:
            inputs = [_rebuild(self.buffers[("in", slot)], d) for d in described]
            # Host bytes are copied into the model's staging buffer (or read, on the CPU) before
            # this returns: the input slot is free for the batch after next from here on.
            return seq, slot, out_bytes, self.model.encode_inputs_async(inputs)
        except Exception as exc:
            self._send_error(seq, exc)
            return None

    def _finish(self, entry: tuple) -> None:
        seq, slot, out_bytes, pending = entry
        try:
            host = pending.wait_packed()
            nbytes = host.numel() * host.element_size()
            if nbytes != out_bytes:
                raise RuntimeError(f"model returned {nbytes} embedding bytes, the batch's grids need {out_bytes}")
            import torch

            target = torch.frombuffer(self.buffers[("out", slot)].array, dtype=host.dtype, count=host.numel())
            target.copy_(host.reshape(-1))
            device_s = pending.device_seconds()
            self.conn.send(("done", seq, device_s if device_s is not None else 0.0, _device_memory(self.model)))
        except Exception as exc:
            self._send_error(seq, exc)

    def _send_error(self, seq: int, exc: Exception) -> None:
        logging.getLogger(__name__).error("forward of batch %d failed", seq, exc_info=exc)
        try:
            self.conn.send(("error", seq, exc))
        except Exception:  # an exception that does not pickle still gets its message across
            self.conn.send(("error", seq, RuntimeError(f"{type(exc).__name__}: {exc}")))


def _rebuild(buffer: SharedBuffer, described: tuple):
    from ..preprocess.staged import DecodedImage, RawPatches

    if described[0] == "image":
        _, offset, nbytes, shape, resize_to, pad_to, grid = described
        return DecodedImage(buffer.view(offset, nbytes).reshape(shape), tuple(resize_to), tuple(pad_to), tuple(grid))
    _, offset, nbytes, dtype, grid = described
    return RawPatches(memoryview(buffer.view(offset, nbytes)), dtype, tuple(grid))


def _device_memory(model) -> tuple[int, int]:
    if model.device.type != "cuda":
        return 0, 0
    import torch

    return torch.cuda.memory_allocated(model.device), torch.cuda.memory_reserved(model.device)

