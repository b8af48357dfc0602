"""A real server's queue, driven from outside (tests/api/test_server_lifecycle.py, and the EPD proxy's
full-queue test): patch requests, waiting on its metrics, calls in threads, and one big image running with
another queued behind it."""

from __future__ import annotations

import threading
import time

import numpy as np
from encoder_client.protocol import encoder_pb2 as pb

BIG_GRID = (1, 128, 128)  # 16384 patches: a forward of a second or more on a 2-core CPU
QUEUE = "encoder_service_queue_images"
BATCHES_STARTED = "encoder_service_queue_seconds_count"  # one sample per image entering a forward


def patches(grid, seed: int, dtype=np.float32) -> tuple[np.ndarray, tuple[int, int, int]]:
    rng = np.random.default_rng(seed)
    n = int(np.prod(grid))
    x = rng.integers(0, 256, (n, 1176), dtype=np.uint8) if dtype == np.uint8 else rng.standard_normal((n, 1176))
    return x.astype(dtype), tuple(grid)


def request(*images: tuple[np.ndarray, tuple[int, int, int]]) -> pb.EncodeRequest:
    enum = {np.dtype(np.uint8): pb.DTYPE_UINT8, np.dtype(np.float32): pb.DTYPE_FLOAT32}
    return pb.EncodeRequest(images=[
        pb.Image(patches=pb.Patches(grid_thw=list(g), dtype=enum[x.dtype], data=x.tobytes())) for x, g in images])


def wait_for(condition, timeout_s: float = 30.0, state=None) -> None:
    """Polls ``condition`` until it holds; past ``timeout_s`` fails with ``state()`` (what was seen
    instead), so a CI report says why."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met in {timeout_s:g} s" + (f"; seen: {state()}" if state else ""))
        time.sleep(0.01)


def queue_state(server, threads=()) -> dict:
    """The metrics the queue tests wait on, and how the calls in ``threads`` ended so far."""
    return {"batches_started": server.metric(BATCHES_STARTED), "queue": server.metric(QUEUE),
            "calls": [{k: (repr(v)[:200] if k == "error" else "ok") for k, v in out.items()} for _, out in threads]}


def in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def one_running_one_queued(server, stub, seeds: tuple[int, int]) -> list[tuple[threading.Thread, dict]]:
    """Two big images in separate forwards, the first running and the second waiting in the queue;
    their calls' ``in_thread`` pairs. The second is sent once the first runs (sent together, their
    order is the network's: the second could find the first still queued, and be refused where the
    queue holds one image), built beforehand so that only its send falls within the first's forward."""
    started = server.metric(BATCHES_STARTED)
    first, second = (request(patches(BIG_GRID, seed, np.uint8)) for seed in seeds)
    big = [in_thread(lambda: list(stub.Encode(first, timeout=120)))]
    wait_for(lambda: server.metric(BATCHES_STARTED) == started + 1, state=lambda: queue_state(server, big))
    big.append(in_thread(lambda: list(stub.Encode(second, timeout=120))))
    wait_for(lambda: server.metric(BATCHES_STARTED) == started + 1 and server.metric(QUEUE) == 1,
             state=lambda: queue_state(server, big))
    return big
