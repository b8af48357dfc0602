"""A lone call (the only call in flight, no image in the engine) has its response built right on the event
loop, not in the response-copy threads (api/streaming.py, ALONE_RESPONSE_BYTES): the hops to a thread that
has been idle cost more than the copy. Checked here, through the real client against the real servicer and
engine (in this process, so the response threads' work can be watched): where each response was built, lone
and not, in a caller's region and on the stream, within the size bound and past it, and that the rows do
not depend on where they were built.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from encoder_client import EncoderClient
from in_process_encoder import InProcessEncoder

from encoder_service.api import servicer as servicer_module
from encoder_service.engine import Engine
from encoder_service.models import load_vision_model

pytestmark = pytest.mark.timeout(120)

GRID = (1, 32, 32)  # 256 tokens of 48 float32 values: 48 KiB, past OFF_LOOP_MIN_BYTES


@pytest.fixture(scope="module")
def model():
    return load_vision_model("tiny-qwen2.5-vl", device="cpu", dtype=torch.float32)


class NotingExecutor(ThreadPoolExecutor):
    """The response-copy threads, noting each piece of work they are given."""

    def __init__(self) -> None:
        super().__init__(max_workers=4, thread_name_prefix="response-copy")
        self.submitted = 0
        self._lock = threading.Lock()

    def submit(self, fn, /, *args, **kwargs):
        with self._lock:
            self.submitted += 1
        return super().submit(fn, *args, **kwargs)


@pytest.fixture(scope="module")
def encoder(model):
    server = InProcessEncoder(model)
    server.servicer.response_copies.shutdown()
    server.servicer.response_copies = NotingExecutor()
    yield server
    server.close()


_seeds = iter(range(1000, 100000))


def patches() -> np.ndarray:
    """New patches (never a cache hit) of GRID."""
    return np.random.default_rng(next(_seeds)).standard_normal((int(np.prod(GRID)), 1176)).astype(np.float32)


def encode(encoder, x: np.ndarray, *, shared_memory: bool, max_chunk_bytes: int | None = None) -> np.ndarray:
    with EncoderClient(encoder.target, timeout_s=60, retries=0, shared_memory=shared_memory) as client:
        (result,) = client.encode([(x, GRID)], max_chunk_bytes=max_chunk_bytes)
        # In a region registered by descriptor (what a client on the host lends by default), not a /dev/shm
        # object (whose writes have threads of their own) nor the stream.
        assert (len(encoder.caller_regions) > 0) is shared_memory
    return result.embedding


@pytest.mark.parametrize("shared_memory", [True, False], ids=["region", "stream"])
def test_a_lone_calls_response_is_built_on_the_event_loop_with_the_same_rows(encoder, model, shared_memory):
    copies = encoder.servicer.response_copies
    x = patches()
    before = copies.submitted
    got = encode(encoder, x, shared_memory=shared_memory)
    assert copies.submitted == before  # no response thread took part
    (want,) = model.encode(x, [GRID])
    np.testing.assert_array_equal(got, want.numpy())


@pytest.mark.parametrize("shared_memory", [True, False], ids=["region", "stream"])
def test_a_response_while_another_call_is_in_flight_is_built_in_the_response_threads(encoder, model,
                                                                                      shared_memory, monkeypatch):
    """A call whose image is still being prepared (held here) is in flight: the next call's response goes
    to the threads, and both calls get their rows."""
    held, release = threading.Event(), threading.Event()
    prepare = Engine._prepare_sync
    slow = patches()

    def held_prepare(engine, image, expensive_pixels):
        if image.kind == "patches" and bytes(image.data[:64]) == slow.tobytes()[:64]:
            held.set()
            release.wait(30)
        return prepare(engine, image, expensive_pixels)

    monkeypatch.setattr(Engine, "_prepare_sync", held_prepare)
    copies = encoder.servicer.response_copies
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(encode, encoder, slow, shared_memory=shared_memory)
        assert held.wait(30)
        before = copies.submitted
        x = patches()
        got = encode(encoder, x, shared_memory=shared_memory)
        assert copies.submitted > before
        release.set()
        slow_rows = first.result(60)
    (want,) = model.encode(x, [GRID])
    np.testing.assert_array_equal(got, want.numpy())
    (want_slow,) = model.encode(slow, [GRID])
    np.testing.assert_array_equal(slow_rows, want_slow.numpy())


def test_a_lone_response_past_the_size_bound_is_built_in_the_response_threads(encoder, model, monkeypatch):
    monkeypatch.setattr(servicer_module, "ALONE_RESPONSE_BYTES", int(np.prod(GRID)) // 4 * 48 * 4 - 1)
    copies = encoder.servicer.response_copies
    for shared_memory in (True, False):
        x = patches()
        before = copies.submitted
        got = encode(encoder, x, shared_memory=shared_memory)
        assert copies.submitted > before, shared_memory
        (want,) = model.encode(x, [GRID])
        np.testing.assert_array_equal(got, want.numpy())


def test_a_lone_response_of_several_chunks_is_built_in_the_response_threads(encoder, model):
    """On the stream, past the chunk budget: each chunk is built in a thread while the one before is written."""
    copies = encoder.servicer.response_copies
    x = patches()
    before = copies.submitted
    got = encode(encoder, x, shared_memory=False, max_chunk_bytes=16 << 10)  # 48 KiB of rows: 3 chunks and more
    assert copies.submitted > before
    (want,) = model.encode(x, [GRID])
    np.testing.assert_array_equal(got, want.numpy())
