"""A lone call (the only call in flight, no image in the engine, one image in the model's dtype) has its
one-chunk response built right on the event loop, not in the response-copy threads (api/streaming.py,
ALONE_REGION_BYTES): the hops to a thread that has been idle cost more than the copy. Checked here, through
the real client against the real servicer and engine (in this process, so the response threads' work can be
watched): where each response was built, lone and not (another call in flight, an engine still busy with a
cancelled call's decode, several images, a conversion, several chunks, past each size bound, a region too
small, a host with swap), in a caller's region and on the stream, and that the rows do not depend on where
they were built.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from encoder_client import EncoderClient
from encoder_client.errors import EncoderClientError
from encoder_client.sink import EmbeddingSinkReceiver
from in_process_encoder import InProcessEncoder

from encoder_service.api import servicer as servicer_module
from encoder_service.benchmarks.reliability.sinks import SinkServer
from encoder_service.engine import Engine
from encoder_service.models import load_vision_model

pytestmark = pytest.mark.timeout(120)

GRID = (1, 32, 32)  # 256 tokens of 48 float32 values: 48 KiB, past OFF_LOOP_MIN_BYTES
LARGE_GRID = (1, 48, 48)  # 576 tokens: 54 KiB in bfloat16
ROW_BYTES = 48 * 4
RESPONSE_BYTES = int(np.prod(GRID)) // 4 * ROW_BYTES


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
    server = InProcessEncoder(model, allowed_sinks="127.0.0.1:*")
    server.servicer.response_copies.shutdown()
    server.servicer.response_copies = NotingExecutor()
    yield server
    server.close()


_seeds = iter(range(1000, 100000))


def patches(grid=GRID) -> np.ndarray:
    """New patches (never a cache hit) of ``grid``."""
    return np.random.default_rng(next(_seeds)).standard_normal((int(np.prod(grid)), 1176)).astype(np.float32)


def grid_of(x: np.ndarray) -> tuple[int, int, int]:
    return GRID if len(x) == np.prod(GRID) else LARGE_GRID


def encode(encoder, *xs: np.ndarray, shared_memory: bool, region_bytes: int | None = None,
           **kwargs) -> list[np.ndarray]:
    sizing = {} if region_bytes is None else {"shared_memory_bytes": region_bytes}
    with EncoderClient(encoder.target, timeout_s=60, retries=0, shared_memory=shared_memory, **sizing) as client:
        results = client.encode([(x, grid_of(x)) for x in xs], **kwargs)
        # In a region registered by descriptor (what a client on the host lends by default), not a /dev/shm
        # object (whose writes have threads of their own) nor the stream. (A region too small for its call
        # is dropped as the call ends, perhaps before this looks: that test checks on its own.)
        if region_bytes is None:
            assert (len(encoder.caller_regions) > 0) is shared_memory
    return [r.embedding for r in results]


def built_where(encoder, model, *xs: np.ndarray, shared_memory: bool, region_bytes: int | None = None,
                **kwargs) -> str:
    """"loop" or "threads": where the call's responses were built; its rows checked against the model's."""
    copies = encoder.servicer.response_copies
    before = copies.submitted
    got = encode(encoder, *xs, shared_memory=shared_memory, region_bytes=region_bytes, **kwargs)
    where = "threads" if copies.submitted > before else "loop"
    for x, rows in zip(xs, got, strict=True):
        (want,) = model.encode(x, [grid_of(x)])
        if kwargs.get("output_dtype") == "bfloat16":
            np.testing.assert_array_equal(rows.astype(np.float32), want.to(torch.bfloat16).float().numpy())
        else:
            np.testing.assert_array_equal(rows, want.numpy())
    return where


@pytest.mark.parametrize("shared_memory", [True, False], ids=["region", "stream"])
def test_a_lone_calls_response_is_built_on_the_event_loop_with_the_same_rows(encoder, model, shared_memory):
    assert built_where(encoder, model, patches(), shared_memory=shared_memory) == "loop"


@contextlib.contextmanager
def held_preparation(monkeypatch):
    """The engine's CPU half of the image (patches) this yields waits until the block ends."""
    held, release = threading.Event(), threading.Event()
    prepare = Engine._prepare_sync
    slow = patches()

    def held_prepare(engine, image, expensive_pixels):
        if image.kind == "patches" and bytes(image.data[:64]) == slow.tobytes()[:64]:
            held.set()
            release.wait(30)
        return prepare(engine, image, expensive_pixels)

    monkeypatch.setattr(Engine, "_prepare_sync", held_prepare)
    try:
        yield slow, held
    finally:
        release.set()


@pytest.mark.parametrize("shared_memory", [True, False], ids=["region", "stream"])
def test_a_response_while_another_calls_image_is_in_the_engine_is_built_in_the_threads(encoder, model,
                                                                                         shared_memory, monkeypatch):
    with ThreadPoolExecutor(1) as pool:
        with held_preparation(monkeypatch) as (slow, held):
            first = pool.submit(encode, encoder, slow, shared_memory=shared_memory)
            assert held.wait(30)
            assert built_where(encoder, model, patches(), shared_memory=shared_memory) == "threads"
        (slow_rows,) = first.result(60)
    (want,) = model.encode(slow, [GRID])
    np.testing.assert_array_equal(slow_rows, want.numpy())


def test_a_response_while_the_engine_still_decodes_for_a_cancelled_call_is_built_in_the_threads(encoder, model,
                                                                                                  monkeypatch):
    """No other call is in flight, but a cancelled call's image still holds a decode thread."""
    with held_preparation(monkeypatch) as (slow, held):
        # Its deadline passes while its image is held.
        with EncoderClient(encoder.target, timeout_s=1.0, retries=0) as client, pytest.raises(EncoderClientError):
            client.encode([(slow, GRID)])
        assert held.is_set()
        calls = encoder.servicer.gate.calls
        deadline = time.monotonic() + 30
        while calls.in_flight and time.monotonic() < deadline:  # the server sees the cancel a moment later
            time.sleep(0.01)
        assert calls.in_flight == 0 and encoder.engine.busy
        assert built_where(encoder, model, patches(), shared_memory=True) == "threads"


class HeldSink(EmbeddingSinkReceiver):
    """A sink that takes a push only once ``release`` is set (``pushing`` says one arrived)."""

    def __init__(self) -> None:
        super().__init__()
        self.pushing, self.release = threading.Event(), threading.Event()

    async def Push(self, request_iterator, context):
        self.pushing.set()
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 30)
        return await super().Push(request_iterator, context)


def test_a_response_while_another_call_waits_on_its_sink_is_built_in_the_threads(encoder, model):
    """The engine is idle (the other call's image is encoded); the other call is still in flight."""
    sink = SinkServer(HeldSink)
    try:
        with ThreadPoolExecutor(1) as pool, EncoderClient(encoder.target, timeout_s=60, retries=0) as client:
            pushed = pool.submit(client.encode_to_sink, [(patches(), GRID)], sink.target)
            try:
                assert sink.servicer.pushing.wait(30)
                assert not encoder.engine.busy
                assert built_where(encoder, model, patches(), shared_memory=True) == "threads"
            finally:
                sink.servicer.release.set()
            assert len(pushed.result(60)) == 1
    finally:
        sink.stop()


@pytest.mark.parametrize("shared_memory", [True, False], ids=["region", "stream"])
def test_a_lone_request_of_several_images_has_its_responses_built_in_the_threads(encoder, model, shared_memory):
    assert built_where(encoder, model, patches(), patches(), shared_memory=shared_memory) == "threads"


@pytest.mark.parametrize("shared_memory", [True, False], ids=["region", "stream"])
def test_a_lone_response_converted_to_another_dtype_is_built_in_the_threads(encoder, model, shared_memory):
    x = patches(LARGE_GRID)  # past OFF_LOOP_MIN_BYTES in bfloat16 too
    assert built_where(encoder, model, x, shared_memory=shared_memory, output_dtype="bfloat16") == "threads"


def test_a_lone_response_of_several_chunks_is_built_in_the_threads(encoder, model):
    """On the stream, past the chunk budget: each chunk is built in a thread while the one before is written."""
    assert built_where(encoder, model, patches(), shared_memory=False, max_chunk_bytes=16 << 10) == "threads"


def test_a_lone_response_past_its_size_bound_is_built_in_the_threads(encoder, model, monkeypatch):
    monkeypatch.setattr(servicer_module, "ALONE_REGION_BYTES", RESPONSE_BYTES - 1)
    assert built_where(encoder, model, patches(), shared_memory=True) == "threads"
    assert built_where(encoder, model, patches(), shared_memory=False) == "loop"  # the stream's own bound
    monkeypatch.setattr(servicer_module, "ALONE_STREAM_BYTES", RESPONSE_BYTES - 1)
    assert built_where(encoder, model, patches(), shared_memory=False) == "threads"


def test_a_lone_response_too_large_for_the_callers_region_goes_by_the_streams_bound(encoder, model, monkeypatch):
    """Rows that do not fit the caller's region go on the stream, so the stream's bound decides, not the region's."""
    small = 4096  # the client's first region, too small for RESPONSE_BYTES
    lent = []  # the registered regions the calls came with (the servicer opens each by its handle)
    writer = encoder.caller_regions.writer

    def noting_writer(handle, size):
        lent.append(size)
        return writer(handle, size)

    monkeypatch.setattr(encoder.caller_regions, "writer", noting_writer)
    monkeypatch.setattr(servicer_module, "ALONE_STREAM_BYTES", RESPONSE_BYTES - 1)
    assert built_where(encoder, model, patches(), shared_memory=True, region_bytes=small) == "threads"
    monkeypatch.setattr(servicer_module, "ALONE_STREAM_BYTES", RESPONSE_BYTES)
    monkeypatch.setattr(servicer_module, "ALONE_REGION_BYTES", RESPONSE_BYTES - 1)
    assert built_where(encoder, model, patches(), shared_memory=True, region_bytes=small) == "loop"
    assert lent == [small, small]


def test_on_a_host_with_swap_a_lone_copy_into_a_region_is_made_in_the_threads(encoder, model, monkeypatch):
    """A caller could have its region's pages written out to swap, for the copy to read back: not on the loop."""
    monkeypatch.setattr(servicer_module, "host_has_swap", lambda: True)
    assert built_where(encoder, model, patches(), shared_memory=True) == "threads"
    assert built_where(encoder, model, patches(), shared_memory=False) == "loop"  # our own memory
