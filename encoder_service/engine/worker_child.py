"""The worker process's side of ``--devices`` (see process_worker.py): load the model on the one
device this process can see, warm it up, then run batches as the front end sends them, two in
flight, answering each with its embeddings in shared memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

from ..config import ServiceConfig
from ..models.served import ServedModel
from .handoff import IN_FLIGHT, POLL_S, rebuild
from .shared_buffer import SharedBuffer


def child_main(conn: Connection, config: ServiceConfig, device: str, label: str, threads: int) -> None:
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
    def __init__(self, conn: Connection, model: ServedModel) -> None:
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
            inputs = [rebuild(self.buffers[("in", slot)], d) for d in described]
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


def _device_memory(model: ServedModel) -> tuple[int, int]:
    if model.device.type != "cuda":
        return 0, 0
    import torch

    return torch.cuda.memory_allocated(model.device), torch.cuda.memory_reserved(model.device)
