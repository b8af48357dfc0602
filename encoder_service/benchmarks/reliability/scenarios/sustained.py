"""Sustained load: many concurrent streams of mixed images (hits and misses, several sizes) against
one server process. Only the intended RESOURCE_EXHAUSTED may fail a call; memory and the cache stay
flat once warm; the rate per interval shows drift over time."""

from __future__ import annotations

import itertools
import threading
import time
from functools import partial

from ..images import ImageSource
from ..load import Background, Recorder, Sampler, closed_loop, interval_rates, mixed_request
from ..result import ScenarioResult
from ..server import CACHE_BYTES, CACHE_CAPACITY, ServerSpec, start_server

ALLOWED = {"OK", "RESOURCE_EXHAUSTED"}


def _level_between(values: list[tuple[float, float]], t0: float, t1: float) -> float:
    """The median sample in [t0, t1): the level the process sits at between the server's trims.

    Not the lowest sample: after each trim RSS dips for a fraction of a second and is back within
    one, so the lowest sample depends on where the 0.25 s sampling fell in that dip (measured on
    four runs: floors moved -4% to +9% between windows, medians -1% to +3%). A leak raises the
    level between trims as much as the dips."""
    window = sorted(v for t, v in values if t0 <= t < t1)
    return window[len(window) // 2] if window else float("nan")


def run(*, duration_s: float = 30.0, warmup_s: float = 8.0, streams: int = 64, intervals: int = 10,
        cache_bytes: int = 4 << 20, spec: ServerSpec = ServerSpec(), log_dir=None,
        max_growth: float = 0.05, max_gap_s: float = 10.0, max_batch_tokens: int = 4096,
        window_s: float = 15.0) -> ScenarioResult:
    """``duration_s`` of measured load after ``warmup_s``; ``cache_bytes`` small enough that the
    warm-up's misses fill the cache (from then on it evicts: its bytes must stay flat).
    ``max_batch_tokens`` keeps each forward's activations (the RSS's swing) small next to the process's level.
    ``max_gap_s`` is a stall detector, not a latency bound: a 2-core box shared with other work
    has been seen to go 6 s between completions."""
    result = ScenarioResult("sustained_load")
    server = start_server("--cache-bytes", str(cache_bytes), "--max-batch-tokens", str(max_batch_tokens),
                          spec=spec, log_dir=log_dir)
    try:
        source = ImageSource(seed=1)
        recorder, stop = Recorder(), threading.Event()
        rss = Sampler(lambda: server.rss_bytes(), 0.25)
        cache = Sampler(lambda: server.metric(CACHE_BYTES), 0.25)
        t_start = time.monotonic()
        load = Background(lambda: closed_loop(server.target, streams=streams, stop=stop, recorder=recorder,
                                              make_request=partial(mixed_request, source), timeout_s=60.0))
        # Warm-up lasts warmup_s and until the cache is nearly full (on a busy box misses come
        # slower), at most 3 x warmup_s: from then on the cache only evicts.
        capacity = server.metric(CACHE_CAPACITY)
        while time.monotonic() < t_start + 3 * warmup_s and server.alive() and (
                time.monotonic() < t_start + warmup_s or server.metric(CACHE_BYTES) < 0.9 * capacity):
            time.sleep(0.25)
        t_warm = time.monotonic()
        t_end = t_warm + duration_s
        while time.monotonic() < t_end and load.running and server.alive():
            time.sleep(0.2)
        stop.set()
        load.join(120)
        rss_values, cache_values = rss.stop(), cache.stop()

        measured = [s for s in recorder.snapshot() if s.start >= t_warm and s.end <= t_end]
        codes = recorder.codes()
        result.figure("streams", streams)
        result.figure("warmup_s", t_warm - t_start)
        result.figure("measured_s", duration_s)
        result.figure("requests", len(measured))
        ok = [s for s in measured if s.code == "OK"]
        result.figure("req_per_s", len(ok) / duration_s)
        result.figure("images_per_s", sum(s.images for s in ok) / duration_s)
        result.latency("latency", [s.seconds for s in ok])
        result.latency("hit_latency", [s.seconds for s in ok if s.kind == "hit"])
        result.latency("miss_latency", [s.seconds for s in ok if s.kind == "miss"])
        result.figure("resource_exhausted", codes.get("RESOURCE_EXHAUSTED", 0))
        rates = interval_rates(ok, t_warm, t_end, duration_s / intervals)
        result.notes.append("req/s per interval: " + " ".join(f"{r:.1f}" for r in rates))
        result.figure("min_interval_req_per_s", min(rates))
        result.figure("max_interval_req_per_s", max(rates))

        # Flatness: the RSS level of the first window after warm-up against that of the run's last
        # window. 15 s windows: under load the server trims freed memory every 15 s, so each window
        # holds one trim and the climb after it (a shorter one may hold none: +/- 7%).
        window = min(window_s, duration_s / 2)
        rss_warm = _level_between(rss_values, t_warm, t_warm + window)
        rss_end = _level_between(rss_values, t_end - window, t_end + 1)
        cache_warm = _level_between(cache_values, t_warm, t_warm + window)
        cache_end = _level_between(cache_values, t_end - window, t_end + 1)
        result.figure("rss_start_mib", rss_values[0][1] / 2**20 if rss_values else float("nan"))
        result.figure("rss_warm_mib", rss_warm / 2**20)
        result.figure("rss_end_mib", rss_end / 2**20)
        result.figure("rss_max_mib", max(v for _, v in rss_values) / 2**20)
        result.figure("rss_growth_pct", 100 * (rss_end - rss_warm) / rss_warm)
        result.figure("cache_warm_mib", cache_warm / 2**20)
        result.figure("cache_end_mib", cache_end / 2**20)
        result.figure("cache_growth_pct", 100 * (cache_end - cache_warm) / max(cache_warm, 1))

        bad = {c: n for c, n in codes.items() if c not in ALLOWED}
        result.check("no error but RESOURCE_EXHAUSTED", not bad, f"codes {dict(codes)}")
        result.check("the server is alive and SERVING", server.alive() and server.health() == "SERVING")
        ends = sorted([t_warm] + [s.end for s in ok] + [t_end])
        gap = max(b - a for a, b in itertools.pairwise(ends))
        result.figure("longest_gap_s", gap)
        result.check(f"no stall: some request completes every {max_gap_s:g} s", gap < max_gap_s, f"{gap:.2f} s")
        result.check(f"RSS growth after warm-up < {max_growth:.0%}", rss_end < rss_warm * (1 + max_growth),
                     f"{rss_warm / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB")
        result.check("cache warmed up (over half full after warm-up)", cache_warm > capacity / 2,
                     f"{cache_warm / 2**20:.2f} of {capacity / 2**20:.2f} MiB")
        result.check(f"cache bytes growth after warm-up < {max_growth:.0%}",
                     cache_end < cache_warm * (1 + max_growth) and max(v for _, v in cache_values) <= capacity,
                     f"{cache_warm / 2**20:.2f} -> {cache_end / 2**20:.2f} MiB, capacity {capacity / 2**20:.2f}")
        result.check("no traceback in the server log", "Traceback" not in server.log_text())
    finally:
        server.stop()
    return result
