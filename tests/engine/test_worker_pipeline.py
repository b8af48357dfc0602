"""A worker process's loop (engine/worker_child.py) holds three batches: one on the device, the next
launched behind it, and a third whose files decode meanwhile, launched only once the first is answered.

The loop runs here on a thread, over a real pipe and real shared buffers, as the front end drives it
(the same messages and descriptors); its device is a stand-in whose batches finish when the test says,
and its decoder one that records which batch it decoded.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pipe
from multiprocessing.reduction import send_handle

import numpy as np
import pytest
import torch

from encoder_service.engine import worker_child
from encoder_service.engine.handoff import IN_FLIGHT, LAUNCHED, SLOTS, describe
from encoder_service.engine.shared_buffer import SharedBuffer
from encoder_service.preprocess.staged import DecodedImage
from encoder_service.preprocess.worker_decode import EncodedImage

pytestmark = pytest.mark.timeout(60)

GRID = (1, 2, 2)
OUT_BYTES = 64  # each batch's embedding bytes (one image)


class _Batch:
    """A launched batch on the stand-in device: done when the test finishes it."""

    def __init__(self, batch_id: int) -> None:
        self.batch_id = batch_id
        self.finished = threading.Event()

    def ready(self) -> bool:
        return self.finished.is_set()

    def wait_packed(self) -> torch.Tensor:
        self.finished.wait()
        return torch.full((OUT_BYTES,), self.batch_id, dtype=torch.uint8)

    def device_seconds(self) -> float:
        return 0.001

    def device_preprocess_seconds(self) -> float:
        return 0.0


class _Model:
    device = torch.device("cpu")


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_worker_decodes_its_third_batch_while_two_are_launched_and_launches_it_once_the_first_is_answered(
        monkeypatch):
    assert (IN_FLIGHT, LAUNCHED) == (3, 2)
    launched: list[_Batch] = []
    decoded: list[int] = []

    def launch(model, inputs):
        batch = _Batch(int(inputs[0].pixels[0, 0, 0]))
        launched.append(batch)
        return batch, {}

    def decoder(data: bytes, max_image_pixels):
        decoded.append(data[0])
        return DecodedImage(np.full((28, 28, 3), data[0], dtype=np.uint8), (28, 28), (28, 28), GRID)

    monkeypatch.setattr(worker_child, "launch_decodable", launch)
    front, child = Pipe()
    with ThreadPoolExecutor(2) as decodes:
        loop = threading.Thread(target=worker_child._ChildLoop(child, _Model(), decoder, decodes).run, daemon=True)
        loop.start()
        buffers = {}
        for role in ("in", "out"):
            for slot in range(SLOTS):
                buffers[role, slot] = SharedBuffer.create(1 << 16)
                front.send(("buffer", role, slot, buffers[role, slot].size))
                send_handle(front, buffers[role, slot].fd, os.getpid())
        for seq in range(IN_FLIGHT):  # what the front end sends: as many batches as a worker holds
            data = bytes([seq]) * 100
            buffers["in", seq].view(0, len(data))[:] = np.frombuffer(data, dtype=np.uint8)
            image = EncodedImage(memoryview(data), (28, 28), (28, 28), GRID, None, None)
            front.send(("batch", seq, seq, [describe(0, image)], [OUT_BYTES]))

        _wait_for(lambda: len(launched) == LAUNCHED and sorted(decoded) == [0, 1, 2])
        time.sleep(0.2)  # the third is decoded, and stays off the device while two are there
        assert [b.batch_id for b in launched] == [0, 1]
        assert not front.poll()  # nothing answered yet

        launched[0].finished.set()
        answer = front.recv()
        assert answer[:2] == ("done", 0)
        assert (buffers["out", 0].view(0, OUT_BYTES) == 0).all()
        _wait_for(lambda: len(launched) == 3)  # room on the device: the third goes on
        assert launched[2].batch_id == 2

        for batch in launched[1:]:
            batch.finished.set()
        assert [front.recv()[:2] for _ in range(2)] == [("done", 1), ("done", 2)]  # in order
        assert (buffers["out", 2].view(0, OUT_BYTES) == 2).all()
        front.send(("stop",))
        loop.join(10)
        assert not loop.is_alive()
    for buffer in buffers.values():
        buffer.close()


def test_an_idle_worker_hands_its_free_memory_back_once_after_a_batch(monkeypatch):
    trims = []
    monkeypatch.setattr(worker_child.memory, "release_free_memory", lambda: trims.append(time.monotonic()))
    monkeypatch.setattr(worker_child, "launch_decodable", lambda model, inputs: (_done_batch(), {}))

    def decoder(data: bytes, max_image_pixels):
        return DecodedImage(np.zeros((28, 28, 3), dtype=np.uint8), (28, 28), (28, 28), GRID)

    front, child = Pipe()
    with ThreadPoolExecutor(1) as decodes:
        child_loop = worker_child._ChildLoop(child, _Model(), decoder, decodes)
        child_loop.idle_trim_s = 0.2
        loop = threading.Thread(target=child_loop.run, daemon=True)
        loop.start()
        buffers = {}
        for role in ("in", "out"):
            buffers[role, 0] = SharedBuffer.create(1 << 16)
            front.send(("buffer", role, 0, buffers[role, 0].size))
            send_handle(front, buffers[role, 0].fd, os.getpid())
        time.sleep(0.5)
        assert trims == []  # no batch yet: nothing to hand back
        image = EncodedImage(memoryview(b"x" * 100), (28, 28), (28, 28), GRID, None, None)
        front.send(("batch", 0, 0, [describe(0, image)], [OUT_BYTES]))
        answered = time.monotonic()
        assert front.recv()[:2] == ("done", 0)
        _wait_for(lambda: len(trims) == 1)
        assert trims[0] - answered >= 0.2  # after the idle spell, not at once
        time.sleep(0.6)
        assert len(trims) == 1  # once per burst
        front.send(("stop",))
        loop.join(10)
        assert not loop.is_alive()
    for buffer in buffers.values():
        buffer.close()


def _done_batch() -> _Batch:
    batch = _Batch(0)
    batch.finished.set()
    return batch
