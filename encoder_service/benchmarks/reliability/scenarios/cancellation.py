"""Cancellation and deadlines: hundreds of callers give up (cancel mid-stream, deadlines shorter than
the work, client processes killed with SIGKILL mid-call). The work stops, the queue and in-flight
gauges return to 0, nothing stays pinned in the cache or stuck as a job, and the server keeps serving.

The server exposes no pin or job count, so both are observed from outside: a leaked job would make a
later request for the same image wait forever (so every given-up image is asked for again, with a
deadline), and a leaked pin would keep its entry from being evicted (so the cache is flooded with
new images afterwards and Lookup must find none of the old ones).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import time

import grpc
from encoder_client import EncoderClient
from encoder_client.protocol import encoder_pb2 as pb
from encoder_client.protocol import encoder_pb2_grpc
from encoder_client.protocol.hashing import hash_encoded

from ..images import ImageSource
from ..result import ScenarioResult
from ..server import IN_FLIGHT, QUEUE_IMAGES, ServerSpec, start_server, wait_until

BIG_SIZES = ((448, 448), (336, 224), (224, 224))  # images whose forward takes a while on a CPU

# The share of the requested images that must go unencoded. Seen: 61-67% on the CPU (the tiny preset,
# CI's 2 cores and the 10-minute soak), 21% on one H100 with the 7B preset, whose forwards finish
# before most callers give up. A server that still encoded the images its callers gave up on
# (BatchQueue.remove broken, every other check green) skipped 6% on the CPU: the floors stand well
# below what works and far above that.
MIN_SKIPPED_PCT = {"cpu": 30.0}
MIN_SKIPPED_PCT_ACCELERATOR = 10.0


async def _give_up(stub, images: list[bytes], mode: str, rng: random.Random) -> str:
    request = pb.EncodeRequest(images=[pb.Image(encoded=im) for im in images])
    if mode == "deadline":
        call = stub.Encode(request, timeout=rng.uniform(0.02, 0.3))
    else:
        call = stub.Encode(request, timeout=60)
    try:
        if mode == "cancel":
            asyncio.get_running_loop().call_later(rng.uniform(0.0, 0.4), call.cancel)
            async for _ in call:
                pass
        elif mode == "first_chunk":  # mid-stream: the first image arrived, the rest is not wanted
            async for _ in call:
                call.cancel()
        else:
            async for _ in call:
                pass
        return "OK"
    except asyncio.CancelledError:
        return "CANCELLED"
    except grpc.RpcError as err:
        return err.code().name


async def _storm(target: str, batches: list[list[bytes]], seed: int, spread_s: float) -> list[str]:
    rng = random.Random(seed)
    modes = ("cancel", "deadline", "first_chunk")
    async with grpc.aio.insecure_channel(target) as channel:
        stub = encoder_pb2_grpc.VisionEncoderStub(channel)

        async def one(i: int, images: list[bytes]) -> str:
            await asyncio.sleep(rng.uniform(0, spread_s))
            return await _give_up(stub, images, modes[i % len(modes)], rng)

        return list(await asyncio.gather(*(one(i, b) for i, b in enumerate(batches))))


def crashing_client(target: str, batches: list[list[bytes]]) -> None:
    """A client process that opens its streams and is then killed (SIGKILL) by the scenario."""
    async def main():
        async with grpc.aio.insecure_channel(target) as channel:
            stub = encoder_pb2_grpc.VisionEncoderStub(channel)
            calls = [stub.Encode(pb.EncodeRequest(images=[pb.Image(encoded=im) for im in b]), timeout=60)
                     for b in batches]
            await asyncio.gather(*(c.read() for c in calls), return_exceptions=True)
            await asyncio.sleep(3600)  # never returns on its own: it is killed
    asyncio.run(main())


def _quiet_after(server, t0: float, quiet_s: float, timeout_s: float) -> tuple[float, float]:
    """Waits until images_encoded_total stays still for quiet_s; returns (seconds from t0 to its last
    change, its value)."""
    name = "encoder_service_images_encoded_total"
    value, changed_at = server.metric(name), t0
    while time.monotonic() - changed_at < quiet_s and time.monotonic() - t0 < timeout_s:
        time.sleep(0.05)
        now = server.metric(name)
        if now != value:
            value, changed_at = now, time.monotonic()
    return changed_at - t0, value


def run(*, callers: int = 240, crashing: int = 2, per_crashing: int = 20, spread_s: float = 3.0,
        cache_bytes: int = 512 << 10, spec: ServerSpec = ServerSpec(), log_dir=None,
        max_drain_s: float = 15.0, max_work_after_s: float = 5.0, recheck: int = 60,
        min_skipped_pct: float | None = None) -> ScenarioResult:
    """``min_skipped_pct``: the share of the requested images that must never be encoded (default
    by device: MIN_SKIPPED_PCT)."""
    result = ScenarioResult("cancellation")
    if min_skipped_pct is None:
        min_skipped_pct = MIN_SKIPPED_PCT.get(spec.device, MIN_SKIPPED_PCT_ACCELERATOR)
    # A queue deep enough for the whole storm: its jobs are what cancellation must clean up.
    server = start_server("--cache-bytes", str(cache_bytes), "--max-batch-tokens", "4096",
                          "--max-queue-images", "2048", spec=spec, log_dir=log_dir)
    try:
        source = ImageSource(seed=4, sizes=BIG_SIZES, formats=("JPEG", "PNG"), hit_pool=0)
        rng = random.Random(4)
        batches = [source.misses(rng.randint(2, 4)) for _ in range(callers)]
        crash_batches = [[source.misses(2) for _ in range(per_crashing)] for _ in range(crashing)]
        requested = sum(map(len, batches)) + 2 * per_crashing * crashing
        encoded_before = server.metric("encoder_service_images_encoded_total")

        # Crashing clients first: their streams are open (some images queued) when they die.
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=crashing_client, args=(server.target, b), daemon=True) for b in crash_batches]
        for proc in procs:
            proc.start()
        t0 = time.monotonic()
        try:
            codes = asyncio.run(_storm(server.target, batches, seed=4, spread_s=spread_s))
        finally:
            for proc in procs:  # mid-call, whatever they have received by now
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(10)
        storm_s = time.monotonic() - t0

        drained = wait_until(lambda: server.metric(QUEUE_IMAGES) == 0 and server.metric(IN_FLIGHT) == 0,
                             max_drain_s)
        result.figure("callers", callers + crashing * per_crashing)
        result.figure("images_requested", requested)
        result.figure("storm_s", storm_s)
        result.figure("drain_s", drained if drained is not None else float("nan"))
        for code in ("OK", "CANCELLED", "DEADLINE_EXCEEDED"):
            result.figure(f"calls_{code.lower()}", codes.count(code))
        # The work stops: once the gauges are at 0, at most the forward already running finishes.
        t_drained = time.monotonic()
        work_stopped_s, encoded = _quiet_after(server, t_drained, quiet_s=1.0, timeout_s=max_work_after_s + 5)
        result.figure("work_after_drain_s", work_stopped_s)
        result.figure("images_encoded", encoded - encoded_before)
        skipped_pct = 100 * (1 - (encoded - encoded_before) / requested)
        result.figure("work_skipped_pct", skipped_pct)

        # RESOURCE_EXHAUSTED: a long soak's storm can outgrow even this queue; refusing is correct.
        result.figure("calls_resource_exhausted", codes.count("RESOURCE_EXHAUSTED"))
        result.check("only OK, CANCELLED, DEADLINE_EXCEEDED (or RESOURCE_EXHAUSTED: queue full)",
                     set(codes) <= {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"},
                     f"{sorted(set(codes))}")
        result.check(f"queue and in-flight gauges back to 0 within {max_drain_s:g} s", drained is not None,
                     f"queue {server.metric(QUEUE_IMAGES):.0f}, in flight {server.metric(IN_FLIGHT):.0f}")
        result.check(f"work stops within {max_work_after_s:g} s of the gauges reaching 0",
                     work_stopped_s < max_work_after_s, f"last image encoded {work_stopped_s:.2f} s after")
        result.check(f"at least {min_skipped_pct:g}% of the requested work skipped", skipped_pct >= min_skipped_pct,
                     f"{skipped_pct:.1f}% skipped: {encoded - encoded_before:.0f} of {requested} images encoded")

        # No leaked job: images given up on are served again (a stuck job would hold them forever).
        with EncoderClient(server.target, timeout_s=60.0, retries=0) as client:
            again = rng.sample([im for b in batches for im in b], min(recheck, requested))
            t = time.monotonic()
            served = sum(len(client.encode(again[i:i + 6], timeout_s=30.0)) for i in range(0, len(again), 6))
            result.figure("recheck_s", time.monotonic() - t)
            result.check("every given-up image is served when asked again", served == len(again),
                         f"{served} of {len(again)}")

            # No leaked pin: flood the cache with new images; every old entry must be evicted.
            namespace = client.cache_namespace()
            old = [hash_encoded(namespace, im) for b in batches for im in b]
            old += [hash_encoded(namespace, im) for cb in crash_batches for b in cb for im in b]
            # Small flood images: their embeddings must fit the cache whatever the model's width
            # (a 448x448 one of the 7B tower is 1.8 MB, more than a small cache holds).
            flood = ImageSource(seed=5, sizes=((56, 56),), formats=("PNG",), hit_pool=0)
            capacity = server.metric("encoder_service_cache_capacity_bytes")
            pushed = 0
            while pushed < 2.5 * capacity:
                pushed += sum(r.embedding.nbytes for r in client.encode(flood.misses(32), timeout_s=30.0))
            still = sum(client.lookup(old))
            result.figure("old_entries_left", still)
            result.check("no pinned entry survives a flood of new images", still == 0,
                         f"{still} of {len(old)} given-up images still cached")
            result.check("cache within its capacity", server.metric("encoder_service_cache_bytes") <= capacity)
        result.check("server alive, SERVING, no traceback", server.alive() and server.health() == "SERVING"
                     and "Traceback" not in server.log_text())
    finally:
        server.stop()
    return result
