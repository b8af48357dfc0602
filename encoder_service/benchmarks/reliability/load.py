"""Client load: many concurrent Encode streams from asyncio tasks, every call recorded.

Load runs on its own thread with its own event loop (grpc.aio channels belong to one loop), so the
scenario's thread stays free to sample the server (/metrics, /proc) and to inject faults.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from encoder_client import AsyncEncoderClient, EncoderClientError

from .images import ImageSource


@dataclass(frozen=True)
class Sample:
    start: float  # time.monotonic() when the call was made
    seconds: float
    code: str  # "OK" or the gRPC status name
    kind: str  # "hit" (every image cached), "miss" (some image new) or the scenario's own label
    images: int = 1
    detail: str = ""  # the error's details, for reports

    @property
    def end(self) -> float:
        return self.start + self.seconds


class Recorder:
    """Samples from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.samples: list[Sample] = []

    def add(self, sample: Sample) -> None:
        with self._lock:
            self.samples.append(sample)

    def snapshot(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)

    def codes(self) -> Counter:
        return Counter(s.code for s in self.snapshot())

    def latencies(self, *, kind: str | None = None, code: str | None = "OK", start: float = float("-inf"),
                  end: float = float("inf")) -> list[float]:
        return [s.seconds for s in self.snapshot() if (kind is None or s.kind == kind)
                and (code is None or s.code == code) and start <= s.start < end]


def interval_rates(samples: list[Sample], t0: float, t1: float, interval_s: float) -> list[float]:
    """OK calls per second completed in each interval of [t0, t1)."""
    n = max(1, int((t1 - t0) // interval_s))
    counts = [0] * n
    for s in samples:
        if s.code == "OK" and t0 <= s.end < t0 + n * interval_s:
            counts[int((s.end - t0) // interval_s)] += 1
    return [c / interval_s for c in counts]


def mixed_request(source: ImageSource, rng: random.Random, hit_ratio: float = 0.5,
                  max_images: int = 3) -> tuple[str, list[bytes]]:
    """1..max_images images, each a cache hit with probability hit_ratio."""
    images = [source.hit() if rng.random() < hit_ratio else source.miss()
              for _ in range(rng.randint(1, max_images))]
    kind = "hit" if all(any(im is h for h in source.hits) for im in images) else "miss"
    return kind, images


async def timed(recorder: Recorder, kind: str, images: int, call: Awaitable) -> str:
    """Awaits call, records it, returns its status name (never raises an RPC error)."""
    started = time.monotonic()
    code, detail = "OK", ""
    try:
        await call
    except EncoderClientError as err:
        code, detail = err.code.name, err.details
    except grpc.RpcError as err:
        code, detail = err.code().name, err.details() or ""
    except asyncio.TimeoutError:
        code = "DEADLINE_EXCEEDED"
    recorder.add(Sample(started, time.monotonic() - started, code, kind, images, detail[:200]))
    return code


async def closed_loop(target: str, *, streams: int, stop: threading.Event, recorder: Recorder,
                      make_request: Callable[[random.Random], tuple[str, list[bytes]]], timeout_s: float = 30.0,
                      channels: int = 4, seed: int = 0, unavailable_backoff_s: float = 0.0,
                      leave_after_unavailable: int = 0) -> None:
    """``streams`` tasks, each sending its next request as soon as the last one ended, until stop.

    ``unavailable_backoff_s``: after UNAVAILABLE a stream waits that long, doubling with each one in
    a row up to 16 times it, as EncoderClient's retries do (0: at once, a client with nowhere else to go).
    ``leave_after_unavailable``: a stream refused UNAVAILABLE that many times in a row stops, as a
    client of a fleet goes to another replica once its retries are spent (0: it never leaves).
    """
    clients = [AsyncEncoderClient(target, timeout_s=timeout_s, retries=0) for _ in range(channels)]

    async def stream(i: int) -> None:
        rng = random.Random(seed * 100003 + i)
        client = clients[i % channels]
        backoff, refused = unavailable_backoff_s, 0
        while not stop.is_set():
            kind, images = make_request(rng)
            code = await timed(recorder, kind, len(images), client.encode(images))
            refused = refused + 1 if code == "UNAVAILABLE" else 0
            if leave_after_unavailable and refused >= leave_after_unavailable:
                return
            if code == "RESOURCE_EXHAUSTED":
                await asyncio.sleep(0.005)  # what a polite client does before trying again
            if code == "UNAVAILABLE" and unavailable_backoff_s > 0:
                await asyncio.sleep(backoff * rng.uniform(0.5, 1.0))
                backoff = min(2 * backoff, 16 * unavailable_backoff_s)
            elif code == "OK":
                backoff = unavailable_backoff_s
    try:
        await asyncio.gather(*(stream(i) for i in range(streams)))
    finally:
        for client in clients:
            await client.close()


class Background:
    """Runs ``coro_factory()`` on a new event loop in a daemon thread; ``join`` re-raises its error."""

    def __init__(self, coro_factory: Callable[[], Awaitable]) -> None:
        self.error: BaseException | None = None
        self.result = None
        self._thread = threading.Thread(target=self._run, args=(coro_factory,), daemon=True)
        self._thread.start()

    def _run(self, coro_factory) -> None:
        try:
            self.result = asyncio.run(coro_factory())
        except BaseException as exc:  # handed to join()
            self.error = exc

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float = 120.0):
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError("background load did not finish")
        if self.error is not None:
            raise self.error
        return self.result


class Sampler:
    """Calls fn() every interval_s on a thread; ``values`` holds (time, value); errors are counted."""

    def __init__(self, fn: Callable[[], float], interval_s: float = 0.05) -> None:
        self.values: list[tuple[float, float]] = []
        self.errors = 0
        self._fn, self._interval = fn, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.values.append((time.monotonic(), float(self._fn())))
            except Exception:
                self.errors += 1
            self._stop.wait(self._interval)

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join(10)
        return self.values


def in_process(fn: Callable, *args):
    """Starts fn(*args) in a fresh (spawned) process; ``.result(timeout)`` returns what it returned.

    Load that must not share a GIL with the measurements (probes, samplers) runs this way; Sample
    times stay comparable across processes (time.monotonic is the system-wide CLOCK_MONOTONIC).
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    future = pool.submit(fn, *args)
    future.add_done_callback(lambda _: pool.shutdown(wait=False))
    return future
