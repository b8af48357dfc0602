"""The worker process's side of ``--devices`` (see process_worker.py): load the model on the one
device this process can see, warm it up, then run batches as the front end sends them, two in
flight, answering each with its embeddings in shared memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

from .. import memory
from ..config import LoadingConfig
from ..errors import EncoderError, InvalidInput
from ..models.served import ServedModel
from ..preprocess.worker_decode import Decoding, submit_decodes
from .handoff import IN_FLIGHT, LAUNCHED, POLL_S, rebuild
from .jobs import detached
from .shared_buffer import SharedBuffer
from .warm_memory import DECODE_BUFFERS
from .worker import launch_decodable

# With no batch for this long after some, the process hands its free memory back (the server's own
# check period, api/server.py): the decode buffers of a burst, and Pillow's cached blocks beyond a few.
IDLE_TRIM_S = 5.0


def child_main(conn: Connection, config: LoadingConfig, device: str, label: str, threads: int,
               setup: Callable[[], None] | None = None) -> None:
    """``setup``: called first, before the model loads: a picklable function the engine was given
    (tests put their stand-ins into the worker process with it; the server passes none)."""
    # Stops come from the front end over the pipe (or its end closing): a Ctrl-C or a SIGTERM sent
    # to the whole process group must not kill a worker in the middle of the drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=config.log_level,
                        format=f"%(asctime)s %(levelname)s [worker {label}] %(name)s: %(message)s")
    # The decode threads below allocate and free megabytes an image, as the server's do: the same bound
    # on glibc's arenas (encoder_service/memory.py), set before any thread exists; on a GPU, large blocks
    # kept in the heap as the server keeps them (not on the CPU, where buffer placement changes float32
    # results: see api/server.py).
    memory.limit_arenas()
    memory.keep_image_blocks()
    if device != "cpu":
        memory.keep_large_blocks_in_heap()
    try:
        import torch

        # On the CPU the forward runs on this process's share of the cores. On a GPU the host's torch work
        # is copying embeddings into the shared buffer: with torch's default intra-op pool (every core)
        # those copies woke OpenMP threads that then spin-wait, in every worker: on a 64-core host with 4
        # GPUs each worker burned 240-310 ms of CPU an image that way, starving the decode threads of all
        # of them (bench/RESULTS.md). One thread copies at memory speed.
        torch.set_num_threads(max(1, threads) if device == "cpu" else 1)
        if setup is not None:
            setup()
        from .loading import load_model
        from .worker import warm_up

        model = load_model(config, device)
        warmup_s = warm_up(model)
    except Exception as exc:
        logging.getLogger(__name__).exception("could not load and warm up the model on %s", label)
        with contextlib.suppress(Exception):
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    front = model.front()
    conn.send(("ready", front, warmup_s))
    # The images the front end hands on undecoded (preprocess/worker_decode.py) decode on these threads
    # while the device runs the batch before: this process's share of the host's cores.
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="decode") as decodes:
        _ChildLoop(conn, model, front.decoder, decodes).run()
    # Interpreter teardown would only make the cuDNN frontend's nanobind module print hundreds of
    # "leaked instance" lines (its objects live in module caches): everything is answered, leave.
    logging.shutdown()
    os._exit(0)


@dataclass
class _Launched:
    """A batch the child took: its files decoding on the pool (``decoding``), in flight on the device
    (``pending``), or already failed (``error``), answered in the order the batches came (the front end
    reads the answers in that order)."""

    seq: int
    slot: int
    out_sizes: list[int]  # each image's embedding bytes
    inputs: list | None = None  # until launched
    decoding: Decoding | None = None  # the files of the batch, until decoded
    launched: bool = False
    out_bytes: int = 0  # the embedding bytes of the images launched (those that decoded)
    pending: object | None = None  # the model's PendingEmbeddings
    failed: dict[int, Exception] = field(default_factory=dict)  # images this process or its device could not decode
    error: Exception | None = None  # the whole batch failed
    decode_s: float = 0.0  # the host decode of the images the front end handed on undecoded

    def answerable(self) -> bool:
        """Whether answering it now would not wait: failed, or launched with its device work done."""
        return self.error is not None or (self.launched and (self.pending is None or self.pending.ready()))


class _ChildLoop:
    """Batches in, answers out, in order, at most ``IN_FLIGHT`` at a time: one on the device, the next
    launched behind it, so the device never idles between the two, and the one after decoding its files
    until there is room on the device (at most ``LAUNCHED`` batches launched). A batch whose files are
    still decoding never holds up the answer of the one ahead of it."""

    def __init__(self, conn: Connection, model: ServedModel, decoder: Callable, decodes: Executor) -> None:
        self.conn = conn
        self.model = model
        self.decoder = decoder  # the family's CPU decoder, for images handed on undecoded
        self.decodes = decodes
        self.buffers: dict[tuple[str, int], SharedBuffer] = {}
        self.idle_trim_s = IDLE_TRIM_S
        self.untrimmed = False  # a batch came since the last trim

    def run(self) -> None:
        pending: deque[_Launched] = deque()
        while True:
            waiting = next((entry for entry in pending if not entry.launched and entry.error is None), None)
            if waiting is not None and _room_on_device(pending) and (waiting.decoding is None
                                                                      or waiting.decoding.done()):
                self._launch(waiting)  # launches stay in the batches' order: only the first not launched
                continue
            if pending and pending[0].answerable():
                self._finish(pending.popleft())
                continue
            try:
                msg = self._wait(pending, waiting)
            except (EOFError, OSError):
                return  # the front end is gone: nobody to answer
            if msg is None:
                continue
            if msg[0] == "stop":
                while pending:
                    self._finish(pending.popleft())
                return
            if msg[0] == "buffer":
                _, role, slot, size = msg
                old = self.buffers.pop((role, slot), None)
                if old is not None:
                    old.close()
                self.buffers[(role, slot)] = SharedBuffer.attach(recv_handle(self.conn), size)
                continue
            pending.append(self._take(msg))

    def _wait(self, pending: deque[_Launched], waiting: _Launched | None) -> tuple | None:
        """The next message where there is room for a batch (None after ``POLL_S`` without one, so the loop
        looks again at the batches it holds); full, the end of a decode or of the oldest batch's device
        work."""
        if not pending:
            if self.untrimmed and not self.conn.poll(self.idle_trim_s):
                DECODE_BUFFERS.trim()  # idle after a burst, as the server's own trim
                memory.release_free_memory()
                self.untrimmed = False
                return None
            return self.conn.recv()
        if len(pending) < IN_FLIGHT:
            return self.conn.recv() if self.conn.poll(POLL_S) else None
        if waiting is not None and _room_on_device(pending):
            waiting.decoding.wait(POLL_S)
        elif pending[0].launched:
            self._finish(pending.popleft())  # nothing else to do until it is done: wait for it there
        return None

    def _take(self, msg: tuple) -> _Launched:
        """A batch as it arrives: its inputs read from the shared buffer, its files submitted for decoding."""
        _, seq, slot, described, out_sizes = msg
        self.untrimmed = True
        entry = _Launched(seq, slot, list(out_sizes))
        try:
            entry.inputs = [rebuild(self.buffers[("in", slot)], d) for d in described]
            entry.decoding = submit_decodes(entry.inputs, self.decoder, self.decodes, DECODE_BUFFERS.take_array)
        except Exception as exc:
            entry.error = exc  # answered in its turn, after the batch ahead of it: never out of order
        return entry

    def _launch(self, entry: _Launched) -> None:
        """Its decoded images onto the device (those that failed to decode fail alone)."""
        try:
            inputs, failed = entry.inputs, {}
            if entry.decoding is not None:
                inputs, decode_failed, entry.decode_s = entry.decoding.result()
                # Without their tracebacks (which hold this batch's pixels in a cycle), MemoryError as
                # RESOURCE_EXHAUSTED: what the front end keeps of a failed preparation (jobs.detached).
                failed = {index: detached(error) for index, error in decode_failed.items()}
                for index, error in failed.items():
                    if not isinstance(error, EncoderError):
                        logging.getLogger(__name__).error("decoding image %d of batch %d failed: %r", index,
                                                          entry.seq, error)
            kept = [index for index in range(len(inputs)) if index not in failed]
            # Host bytes are copied into the model's staging buffer (or read, on the CPU; JPEGs are
            # decoded) before this returns: the input slot is free for its next batch (SLOTS on) from here on.
            batch, on_device = launch_decodable(self.model, [inputs[i] for i in kept]) if kept else (None, {})
            failed.update({kept[position]: error for position, error in on_device.items()})
        except Exception as exc:
            entry.error = exc
            return
        finally:
            entry.inputs = entry.decoding = None
            entry.launched = True
        entry.pending, entry.failed = batch, failed
        entry.out_bytes = sum(size for index, size in enumerate(entry.out_sizes) if index not in failed)

    def _finish(self, entry: _Launched) -> None:
        if not entry.launched and entry.error is None:  # stopping: its decodes finish first
            self._launch(entry)
        if entry.error is not None:
            self._send_error(entry.seq, entry.error)
            return
        try:
            device_s = preprocess_s = None
            if entry.pending is not None:  # None: no image of the batch decoded
                host = entry.pending.wait_packed()
                nbytes = host.numel() * host.element_size()
                if nbytes != entry.out_bytes:
                    raise RuntimeError(f"model returned {nbytes} embedding bytes, the batch's grids need "
                                       f"{entry.out_bytes}")
                import torch

                target = torch.frombuffer(self.buffers[("out", entry.slot)].array, dtype=host.dtype,
                                          count=host.numel())
                target.copy_(host.reshape(-1))
                device_s = entry.pending.device_seconds()
                preprocess_s = entry.pending.device_preprocess_seconds()
            failed = {index: _portable(error) for index, error in entry.failed.items()}
            self.conn.send(("done", entry.seq, device_s if device_s is not None else 0.0, preprocess_s,
                            _device_memory(self.model), failed, entry.decode_s))
        except Exception as exc:
            self._send_error(entry.seq, exc)

    def _send_error(self, seq: int, exc: Exception) -> None:
        logging.getLogger(__name__).error("forward of batch %d failed", seq, exc_info=exc)
        self.conn.send(("error", seq, _portable(exc, RuntimeError)))


def _room_on_device(pending: deque[_Launched]) -> bool:
    """Whether another batch may be launched: fewer than ``LAUNCHED`` launched and not yet answered."""
    return sum(1 for entry in pending if entry.launched and entry.error is None) < LAUNCHED


def _portable(exc: Exception, fallback: type[Exception] = InvalidInput) -> Exception:
    """``exc`` if it survives the pipe (pickled here, unpickled on the front end), else ``fallback``
    with its message: an exception that does not unpickle would stop the front end's reader."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return fallback(f"{type(exc).__name__}: {exc}")


def _device_memory(model: ServedModel) -> tuple[int, int]:
    if model.device.type != "cuda":
        return 0, 0
    import torch

    return torch.cuda.memory_allocated(model.device), torch.cuda.memory_reserved(model.device)
