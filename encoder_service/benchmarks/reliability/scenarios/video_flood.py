"""Video flood: hostile clips mixed into normal traffic against one server process.

Normal callers (``normal_streams`` closed-loop streams) send what a well-behaved client sends, each
call with a deadline: single 448x448 photos (JPEG or PNG, never seen before) and small H.264 clips
sampled to 8 frames. Hostile callers (``hostile_streams`` streams in a process of their own) are
another client: the server checks bearer tokens (``--auth-token-file``, its one flag here besides the
budgets below) and tells clients apart by them, and the two kinds of callers present different ones
(by address they would be one client: on one host every client connects from 127.0.0.1, and ::1 is
not on every host). The hostile callers send in turn, each with a deadline:

- ``bomb``: a decode bomb, a VP9 WebM of one 1792x1792 key frame and then empty inter frames
  (``bomb_frames`` of them), sampled to 2 frames: tiny to send, long to walk through;
- ``png_frames``: clips given as frames, ``png_clips`` in one request, each of ``png_frames`` big RGBA PNGs
  (1380x1380, about 150 KB each but 1.9 Mpx to inflate), ``png_sampled`` of them sampled;
- ``pixel_bounds``: a few frames of a tiny GIF with the caller's pixel bounds
  (VideoSampling min_pixels = max_pixels) at 1e8: a resize to 100 Mpx a frame if taken as asked;
- ``cancel``: a decode bomb cancelled a fraction of a second after it was sent.

Phases: warm-up (normal traffic), idle until the server has trimmed its memory (RSS before); normal
traffic alone for ``duration_s`` (the baseline), then the same traffic for ``duration_s`` more with the
flood beside it; then everything stops, the server drains and idles again (RSS after), and serves one
more image and clip.

Every clip differs from the ones before it in the content hash (a clip's max_frames and min_frames,
which sampling by num_frames does not read, are part of it): no call is a cache hit, every one is
decoded. Every gRPC call has a deadline and every wait here is bounded: the scenario never hangs.

Checks: no INTERNAL or UNKNOWN for anyone; every normal call OK (``max_normal_errors``, 0 by default),
alone and under the flood; hostile calls get only OK, RESOURCE_EXHAUSTED, INVALID_ARGUMENT,
CANCELLED or DEADLINE_EXCEEDED; the normal callers' p99 under the flood within ``max_p99_increase_s``
of their p99 alone, images and clips each; the server's RSS after the flood within
``max_rss_after_growth_mib`` of before; its peak during the flood within the budget the server's
configuration sets (see ``run``); the server drained, alive, SERVING, without a traceback, and serving.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import random
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
from encoder_client import AsyncEncoderClient, EncoderClient, EncoderClientError, Video

from ..images import ImageSource
from ..load import Background, Recorder, Sample, Sampler, timed
from ..result import ScenarioResult
from ..server import IN_FLIGHT, EncoderProcess, ServerSpec, start_server, wait_until
from ..video_inputs import big_png, decode_bomb, frame_pattern, make_clip, tiny_gif

NEVER = frozenset({"INTERNAL", "UNKNOWN"})
HOSTILE_ALLOWED = frozenset({"OK", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "CANCELLED", "DEADLINE_EXCEEDED"})
HOSTILE_KINDS = ("bomb", "png_frames", "pixel_bounds", "cancel")
NORMAL_KINDS = ("image", "clip")
CLIP_FRAMES, CLIP_SAMPLED, CLIP_SIZE = 16, 8, (112, 84)
MIB = 1 << 20
AT_THE_END = "cancelled at the end of the flood"
# A request in flight is in the server's memory three times: the raw bytes gRPC's aio server received
# (its handler coroutine keeps them referenced until the call ends), the message parsed from them, and
# the frames' bytes the engine reads from the message.
REQUEST_COPIES = 3
NORMAL_TOKEN, HOSTILE_TOKEN = "normal-callers", "hostile-callers"  # two clients to the server
WARMUP_CALLS = 20
# The largest hostile request sent: under both the client's and the server's 64 MiB message limit and
# the server's --max-video-bytes, so that each one reaches the decoders instead of being refused whole.
MAX_HOSTILE_REQUEST_BYTES = 60 * MIB


def _variant(n: int) -> dict[str, int]:
    """Sampling settings that sampling by num_frames does not read but the content hash does: the
    n-th variant of a clip is a new cache entry (48,640 of them with 8 clips) and decodes again."""
    return {"max_frames": 8 + n % 760, "min_frames": 1 + (n // 760) % 8}


# --- the inputs (module-level and picklable: the hostile callers run in a process of their own) -------

@dataclass(frozen=True)
class Hostility:
    """What the hostile callers send (see the module docstring)."""

    streams: int = 4
    timeout_s: float = 5.0  # each hostile call's deadline: several calls a stream within the flood
    bomb_frames: int = 1800  # decode_bomb's; 18000 (--max-video-frames' default) in the soak
    bomb_side: int = 1792
    png_clips: int = 2  # clips in one png_frames request
    png_frames: int = 180  # frames of each (fewer if the request would pass MAX_HOSTILE_REQUEST_BYTES)
    png_distinct: int = 2  # distinct PNGs among them (a sampled frame is decoded whichever it is)
    png_sampled: int = 8  # 8 x 1380 x 1380 x 3 = 44 MiB decoded a clip: within --max-video-decoded-bytes
    gif_frames: int = 4
    pixel_bound: int = 10**8
    cancel_after_s: tuple[float, float] = (0.05, 0.5)


def _normal_clips(count: int = 8) -> list[bytes]:
    width, height = CLIP_SIZE
    return [make_clip("mp4", "libx264", frames=CLIP_FRAMES, width=width, height=height, fps=10,
                      pattern=lambda i, w, h, k=k: frame_pattern(i + CLIP_FRAMES * k, w, h)) for k in range(count)]


class NormalTraffic:
    """A well-behaved client's requests: a new 448x448 photo, or a new small clip sampled to 8 frames."""

    def __init__(self, seed: int, clip_share: float = 0.5) -> None:
        self.images = ImageSource(seed=seed, sizes=((448, 448),), formats=("JPEG", "PNG"), hit_pool=0)
        self.clips = _normal_clips()
        self.clip_share = clip_share
        self._serial = itertools.count()
        self._lock = threading.Lock()

    def clip(self) -> Video:
        with self._lock:
            n = next(self._serial)
        return Video(self.clips[n % len(self.clips)], num_frames=CLIP_SAMPLED, **_variant(n // len(self.clips)))

    def request(self, rng: random.Random) -> tuple[str, list]:
        if rng.random() < self.clip_share:
            return "clip", [self.clip()]
        return "image", [self.images.miss()]


async def _normal_load(target: str, streams: int, stop: threading.Event, recorder: Recorder, traffic: NormalTraffic,
                       timeout_s: float, seed: int) -> None:
    clients = [AsyncEncoderClient(target, timeout_s=timeout_s, retries=0, token=NORMAL_TOKEN)
               for _ in range(min(2, streams))]

    async def stream(i: int) -> None:
        rng = random.Random(seed * 7919 + i)
        client = clients[i % len(clients)]
        while not stop.is_set():
            kind, images = traffic.request(rng)
            # The gRPC deadline ends the call; wait_for is a second bound, should the client not.
            code = await timed(recorder, kind, len(images), asyncio.wait_for(client.encode(images), timeout_s + 5))
            if code != "OK":
                await asyncio.sleep(0.05)  # what a polite client does before it tries again
    try:
        await asyncio.gather(*(stream(i) for i in range(streams)))
    finally:
        for client in clients:
            await client.close()


# --- the hostile callers' process ------------------------------------------------------------------

def _hostile_inputs(h: Hostility) -> dict:
    pngs = [big_png(seed=s) for s in range(h.png_distinct)]
    frames = [pngs[i % len(pngs)] for i in range(h.png_frames)]
    while len(frames) > 1 and h.png_clips * sum(map(len, frames)) > MAX_HOSTILE_REQUEST_BYTES:
        frames.pop()
    return {"bomb": decode_bomb(h.bomb_side, h.bomb_side, frames=h.bomb_frames), "png_frames": frames,
            "gif": tiny_gif()}


def _hostile_request(kind: str, inputs: dict, h: Hostility, n: int) -> list[Video]:
    """The n-th hostile request (n makes its clips new to the cache)."""
    if kind in ("bomb", "cancel"):
        return [Video(inputs["bomb"], num_frames=2, **_variant(n))]
    if kind == "png_frames":
        sampled = max(2, min(h.png_sampled, len(inputs["png_frames"])) // 2 * 2)  # at most every frame
        return [Video(frames=inputs["png_frames"], frames_fps=30.0, num_frames=sampled,
                      **_variant(n * h.png_clips + i)) for i in range(h.png_clips)]
    return [Video(frames=[inputs["gif"]] * h.gif_frames, frames_fps=10.0, num_frames=2, min_pixels=h.pixel_bound,
                  max_pixels=h.pixel_bound, **_variant(n))]


async def _hostile_call(recorder: Recorder, client: AsyncEncoderClient, kind: str, clips: list[Video], h: Hostility,
                        rng: random.Random) -> None:
    started = time.monotonic()
    code, detail = "OK", ""
    task = asyncio.ensure_future(client.encode(clips))
    try:
        if kind == "cancel":
            done, _ = await asyncio.wait([task], timeout=rng.uniform(*h.cancel_after_s))
            if not done:
                task.cancel()  # the client cancels the call (the server sees CANCELLED)
                code, detail = "CANCELLED", "cancelled by the caller"
        done, _ = await asyncio.wait([task], timeout=h.timeout_s + 5)  # the deadline ends it first
        if not done:
            task.cancel()
            code, detail = "DEADLINE_EXCEEDED", "no answer within the deadline + 5 s"
        elif code == "OK":
            try:
                task.result()
            except EncoderClientError as err:
                code, detail = err.code.name, err.details
            except Exception as exc:  # the client failed on its own side: shown, and not an allowed code
                code, detail = f"CLIENT_{type(exc).__name__}", str(exc)
    except asyncio.CancelledError:  # the flood is over: calls still in flight are cancelled
        task.cancel()
        code, detail = "CANCELLED", AT_THE_END
        raise
    finally:
        recorder.add(Sample(started, time.monotonic() - started, code, kind, len(clips), detail[:200]))


async def _hostile_load(target: str, h: Hostility, inputs: dict, stop, seed: int, max_s: float) -> list[Sample]:
    recorder = Recorder()
    # Responses streamed (no shared memory): a caller from elsewhere, as its own address says.
    clients = [AsyncEncoderClient(target, timeout_s=h.timeout_s, retries=0, shared_memory=False, token=HOSTILE_TOKEN)
               for _ in range(min(2, h.streams))]
    serial = itertools.count()

    async def stream(i: int) -> None:
        rng = random.Random(seed * 104729 + i)
        client = clients[i % len(clients)]
        for kind in itertools.islice(itertools.cycle(HOSTILE_KINDS), i % len(HOSTILE_KINDS), None):
            n = next(serial)
            await _hostile_call(recorder, client, kind, _hostile_request(kind, inputs, h, n), h, rng)
            await asyncio.sleep(0.01)

    tasks = [asyncio.ensure_future(stream(i)) for i in range(h.streams)]
    try:
        await asyncio.to_thread(stop.wait, max_s)
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        for client in clients:
            await client.close()
    return recorder.snapshot()


def _hostile_process(conn, h: Hostility, seed: int, stop, max_s: float) -> None:
    """Builds the inputs, says ready (with their sizes), waits for the target (at most max_s), floods it
    until ``stop`` (at most max_s), and sends back its samples."""
    try:
        inputs = _hostile_inputs(h)
        conn.send(("ready", {"bomb_bytes": len(inputs["bomb"]), "png_frames": len(inputs["png_frames"]),
                             "png_request_bytes": h.png_clips * sum(map(len, inputs["png_frames"])),
                             "png_bytes": len(inputs["png_frames"][0]), "gif_bytes": len(inputs["gif"])}))
        target = conn.recv() if conn.poll(max_s) else None
        samples = asyncio.run(_hostile_load(target, h, inputs, stop, seed, max_s)) if target else []
        conn.send(("samples", samples))
    except BaseException as exc:  # reported to the scenario, which fails a check with it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


class HostileCallers:
    """The hostile process, seen from the scenario; every wait bounded, the process killed at the end.
    Started before the server, so that it builds its inputs (seconds of CPU) while the server loads."""

    def __init__(self, h: Hostility, seed: int, max_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_hostile_process, args=(child, h, seed, self._stop, max_s), daemon=True)
        self._proc.start()
        child.close()
        self.sizes: dict[str, int] = {}
        self.error = ""

    def _receive(self, timeout_s: float):
        if self._conn.poll(timeout_s):
            try:
                return self._conn.recv()
            except EOFError:
                pass
        return ("error", f"the hostile process sent nothing in {timeout_s:g} s (alive: {self._proc.is_alive()}, "
                         f"exit code {self._proc.exitcode})")

    def wait_ready(self, timeout_s: float) -> bool:
        what, value = self._receive(timeout_s)
        if what == "ready":
            self.sizes = value
            return True
        self.error = str(value)
        return False

    def go(self, target: str) -> None:
        self._conn.send(target)

    def stop(self, timeout_s: float) -> list[Sample]:
        self._stop.set()
        if not self.sizes:  # never ready: nothing to collect
            return []
        what, value = self._receive(timeout_s)
        if what == "samples":
            return value
        self.error = self.error or str(value)
        return []

    def close(self) -> None:
        self._stop.set()
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


# --- the server process, seen from /proc ------------------------------------------------------------

def _stat_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _tree_cpu_s(server: EncoderProcess) -> float:
    """CPU seconds of the server, of its live decoder processes and of its children it has reaped
    (decoders killed and replaced: cutime + cstime)."""
    reaped = sum(int(f) for f in _stat_fields(server.pid)[13:15]) / os.sysconf("SC_CLK_TCK")
    return server.cpu_s() + sum(server.decoders_cpu_s().values()) + reaped


def _decoders_rss(server: EncoderProcess) -> float:
    total = 0
    for pid in server.decoder_pids():
        try:
            total += next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if line.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError):
            continue
    return total


def _level(values: list[tuple[float, float]], t0: float, t1: float) -> float:
    """The median sample in [t0, t1]."""
    window = sorted(v for t, v in values if t0 <= t <= t1)
    return window[len(window) // 2] if window else float("nan")


def _idle(server: EncoderProcess, rss: Sampler, idle_s: float) -> tuple[float, float]:
    """Waits idle_s with no call (the server trims its memory after MEMORY_CHECK_S to twice that with
    no new call) and returns (the RSS level over the last 2 s, when the wait ended)."""
    end = time.monotonic() + idle_s
    while time.monotonic() < end and server.alive():
        time.sleep(0.1)
    t = time.monotonic()
    return _level(rss.values, t - 2.0, t), t


def _health(server: EncoderProcess) -> str:
    try:
        return server.health()
    except grpc.RpcError as err:
        return err.code().name


def _codes(samples: list[Sample]) -> dict[str, int]:
    return dict(sorted(Counter(s.code for s in samples).items()))


def _probe(server: EncoderProcess, traffic: NormalTraffic, timeout_s: float) -> tuple[bool, str]:
    """One new image and one new clip from a new normal client: both must come back OK."""
    try:
        with EncoderClient(server.target, timeout_s=timeout_s, retries=0, token=NORMAL_TOKEN) as client:
            client.encode([traffic.images.miss()])
            client.encode([traffic.clip()])
        return True, "an image and a clip OK"
    except EncoderClientError as err:
        return False, f"{err.code.name}: {err.details[:200]}"


def run(*, duration_s: float = 10.0, warmup_s: float = 4.0, idle_s: float = 11.0, normal_streams: int = 4,
        normal_timeout_s: float = 10.0, hostility: Hostility = Hostility(), decoders: int = 3,
        max_video_decoded_bytes: int = 64 * MIB, cache_bytes: int = 2 * MIB, max_requests_per_client: int = 0,
        spec: ServerSpec = ServerSpec(), log_dir=None, seed: int = 0, max_normal_errors: int = 0,
        max_p99_increase_s: float = 3.0, max_rss_after_growth_mib: float = 64.0, peak_slack_mib: float = 64.0,
        drain_timeout_s: float = 30.0) -> ScenarioResult:
    """``duration_s`` of normal traffic alone, then as long with the flood (see the module docstring).

    The server runs with its defaults but for ``decoders`` video decoder processes (3, the CPU's
    default, stated so that a GPU host's larger default does not change the budget) and
    ``max_video_decoded_bytes`` (--max-video-decoded-bytes, the most a clip's sampled frames may take
    decoded): the budgets the peak RSS is held to (``peak budget`` below), explicit so that it does not
    depend on the machine. Every hostile clip passes those budgets (2 sampled 1792x1792 frames are 18 MiB
    decoded, 8 sampled 1380x1380 frames 44 MiB): each is work the server has taken on, not one it
    refused at the door. ``cache_bytes`` keeps the embedding cache (every call is a miss) from growing
    past a few MiB. ``max_requests_per_client`` > 0 sets --max-requests-per-client.

    Peak budget: the growth over RSS before that normal traffic alone reached, plus, for the flood, a
    clip's decoded frames per decoder process (``decoders`` x ``max_video_decoded_bytes``: what the
    decoders can hand the server at once), plus the hostile requests in flight (``hostility.streams``
    x the largest hostile request, held three times while served: the raw bytes gRPC received, which its
    aio server keeps referenced in the handler's frame until the call ends, the message parsed from
    them, and its frames as the Python bytes the engine reads from it), plus ``peak_slack_mib``.
    """
    result = ScenarioResult("video_flood")
    h = hostility
    tokens = Path(tempfile.mkdtemp(prefix="video-flood-")) / "tokens"
    tokens.write_text(f"{NORMAL_TOKEN}\n{HOSTILE_TOKEN}\n")
    flags = ["--auth-token-file", str(tokens), "--video-decode-processes", str(decoders),
             "--max-video-decoded-bytes", str(max_video_decoded_bytes), "--cache-bytes", str(cache_bytes)]
    if max_requests_per_client > 0:
        flags += ["--max-requests-per-client", str(max_requests_per_client)]
    t_begin = time.monotonic()
    # The longest the hostile process waits for its target or floods, should the scenario never say stop.
    hostile = HostileCallers(h, seed, max_s=6 * duration_s + 300)
    rss: Sampler | None = None
    stops: list[threading.Event] = []
    server: EncoderProcess | None = None
    try:
        server = start_server(*flags, spec=spec, log_dir=log_dir)
        result.figure("server_start_s", time.monotonic() - t_begin)
        hostile_target = server.target
        ready = hostile.wait_ready(120.0)  # its inputs built: they take no CPU from the warm-up
        result.figure("hostile_ready_s", time.monotonic() - t_begin)
        rss = Sampler(lambda: server.rss_bytes(), 0.1)
        traffic = NormalTraffic(seed=seed + 11)
        recorder = Recorder()

        def normal_load() -> tuple[threading.Event, Background]:
            stop = threading.Event()
            stops.append(stop)
            return stop, Background(lambda: _normal_load(server.target, normal_streams, stop, recorder, traffic,
                                                         normal_timeout_s, seed))

        # Warm-up: normal traffic for warmup_s and until WARMUP_CALLS of each kind came back OK (the
        # decoder processes start with the first clip; the allocator's arenas fill), at most 4 x warmup_s.
        t_warm = time.monotonic()
        stop, load = normal_load()
        def warm() -> bool:
            ok = Counter(s.kind for s in recorder.snapshot() if s.code == "OK")
            return time.monotonic() >= t_warm + warmup_s and all(ok[k] >= WARMUP_CALLS for k in NORMAL_KINDS)

        while server.alive() and load.running and time.monotonic() < t_warm + 4 * warmup_s and not warm():
            time.sleep(0.1)
        stop.set()
        load.join(normal_timeout_s + 30)
        warm_samples = recorder.snapshot()
        result.figure("warmup_s", time.monotonic() - t_warm)
        rss_before, t_before = _idle(server, rss, idle_s)
        hwm_before = server.peak_rss_bytes()
        decoders_before = len(server.decoder_pids())
        cpu_before = _tree_cpu_s(server)

        # Baseline, then the flood; the normal traffic runs through both.
        t_b0 = time.monotonic()
        stop, load = normal_load()
        while time.monotonic() < t_b0 + duration_s and server.alive() and load.running:
            time.sleep(0.05)
        t_f0 = time.monotonic()
        cpu_alone = _tree_cpu_s(server) - cpu_before
        if ready:
            hostile.go(hostile_target)
        while time.monotonic() < t_f0 + duration_s and server.alive() and load.running:
            time.sleep(0.05)
        t_f1 = time.monotonic()
        cpu_flood = _tree_cpu_s(server) - cpu_before - cpu_alone
        stop.set()
        hostile_samples = hostile.stop(h.timeout_s + 30)
        load.join(normal_timeout_s + 30)
        drained_after = wait_until(lambda: server.metric(IN_FLIGHT) == 0, drain_timeout_s, 0.1)
        t_drained = time.monotonic()
        hwm_after = server.peak_rss_bytes()
        decoder_cpu_before_idle = server.decoders_cpu_s()
        rss_after, t_after = _idle(server, rss, idle_s)
        decoder_cpu_after_idle = server.decoders_cpu_s()
        decoders_after = len(server.decoder_pids())
        decoders_rss = _decoders_rss(server)
        serves, serves_detail = _probe(server, traffic, 30.0) if server.alive() else (False, "server exited")
        rss_values = rss.stop()

        # --- figures ---------------------------------------------------------------------------
        normal = [s for s in recorder.snapshot() if s.start >= t_b0]
        alone = [s for s in normal if s.start < t_f0]
        flood = [s for s in normal if s.start >= t_f0]
        result.figure("normal_streams", normal_streams)
        result.figure("hostile_streams", h.streams)
        result.figure("duration_s", duration_s)
        result.figure("flood_s", t_f1 - t_f0)
        for kind in NORMAL_KINDS:
            result.latency(f"{kind}_alone", [s.seconds for s in alone if s.kind == kind])
            result.latency(f"{kind}_flood", [s.seconds for s in flood if s.kind == kind])
        normal_alone_errors = sum(s.code != "OK" for s in alone)
        normal_flood_errors = sum(s.code != "OK" for s in flood)
        result.figure("normal_alone_errors", normal_alone_errors)
        result.figure("normal_flood_errors", normal_flood_errors)
        result.figure("normal_flood_deadline_exceeded", sum(s.code == "DEADLINE_EXCEEDED" for s in flood))
        result.figure("hostile_calls", len(hostile_samples))
        for code, n in _codes(hostile_samples).items():
            result.figure(f"hostile_{code.lower()}", n)
        result.notes.append(f"normal codes: warm-up {_codes(warm_samples)}, alone {_codes(alone)}, "
                            f"under the flood {_codes(flood)}")
        result.notes.append("hostile codes: " + "; ".join(
            f"{kind} {_codes([s for s in hostile_samples if s.kind == kind])}" for kind in HOSTILE_KINDS))
        for kind in HOSTILE_KINDS:
            result.latency(f"hostile_{kind}", [s.seconds for s in hostile_samples
                                               if s.kind == kind and s.detail != AT_THE_END])
        details = Counter(f"{s.kind} {s.code}: {s.detail[:120]}" for s in hostile_samples + normal
                          if s.code not in ("OK", "CANCELLED"))
        result.notes += [f"{n} x {d}" for d, n in details.most_common(8)]
        if hostile.sizes:
            result.notes.append("hostile inputs: " + ", ".join(f"{k} {v}" for k, v in hostile.sizes.items()))

        alone_peak = max((v for t, v in rss_values if t_b0 <= t < t_f0), default=float("nan"))
        flood_peak = max((v for t, v in rss_values if t_f0 <= t <= t_drained), default=float("nan"))
        if hwm_after > hwm_before:  # the flood set a new high-water mark: that is its peak, to the page
            flood_peak = max(flood_peak, hwm_after)
        largest_request = max(hostile.sizes.get("bomb_bytes", 0), hostile.sizes.get("png_request_bytes", 0))
        budget = (max(alone_peak - rss_before, 0.0) + decoders * max_video_decoded_bytes
                  + REQUEST_COPIES * h.streams * largest_request
                  + peak_slack_mib * MIB)
        result.figure("rss_before_mib", rss_before / MIB)
        result.figure("rss_alone_peak_mib", alone_peak / MIB)
        result.figure("rss_flood_peak_mib", flood_peak / MIB)
        result.figure("rss_after_mib", rss_after / MIB)
        result.figure("rss_peak_growth_mib", (flood_peak - rss_before) / MIB)
        result.figure("rss_after_growth_mib", (rss_after - rss_before) / MIB)
        result.figure("peak_budget_mib", budget / MIB)
        result.figure("vm_hwm_mib", hwm_after / MIB)
        result.figure("server_cpu_alone_s", cpu_alone)  # the server and its decoder processes
        result.figure("server_cpu_flood_s", cpu_flood)
        result.figure("decoders_before", decoders_before)
        result.figure("decoders_after", decoders_after)
        result.figure("decoders_rss_after_mib", decoders_rss / MIB)
        # Decoding still going on after the flood (work of callers who had gone): CPU of the decoder
        # processes that lived through the idle wait.
        result.figure("decoder_cpu_idle_s", sum(decoder_cpu_after_idle[p] - decoder_cpu_before_idle[p]
                                                for p in decoder_cpu_after_idle if p in decoder_cpu_before_idle))
        result.figure("drain_s", drained_after if drained_after is not None else float("nan"))
        result.figure("idle_after_s", t_after - t_drained)
        result.figure("before_s", t_before - t_warm)

        # --- checks ---------------------------------------------------------------------------
        everyone = warm_samples + normal + hostile_samples
        never = Counter(f"{s.kind} {s.code}" for s in everyone if s.code in NEVER)
        result.check("no INTERNAL or UNKNOWN for anyone", not never, f"{dict(never)}")
        result.check("the hostile callers ran", ready and not hostile.error and all(
            any(s.kind == kind for s in hostile_samples) for kind in HOSTILE_KINDS),
            hostile.error or f"{len(hostile_samples)} calls: {_codes(hostile_samples)}")
        result.check(f"normal callers: at most {max_normal_errors} calls not OK, alone and under the flood",
                     normal_alone_errors + normal_flood_errors <= max_normal_errors,
                     f"alone {_codes(alone)}, under the flood {_codes(flood)}")
        bad = {c: n for c, n in _codes(hostile_samples).items() if c not in HOSTILE_ALLOWED}
        result.check("hostile callers get only " + ", ".join(sorted(HOSTILE_ALLOWED)), not bad, f"{bad}")
        for kind in NORMAL_KINDS:
            a, f = result.figures[f"{kind}_alone_p99_ms"], result.figures[f"{kind}_flood_p99_ms"]
            n_a, n_f = result.figures[f"{kind}_alone_n"], result.figures[f"{kind}_flood_n"]
            result.check(f"normal {kind}s: p99 under the flood <= p99 alone + {max_p99_increase_s:g} s (every call, "
                         "failed ones included)", n_a >= 5 and n_f >= 5 and f <= a + max_p99_increase_s * 1000,
                         f"{a:.0f} ms alone ({n_a:.0f} calls) -> {f:.0f} ms under the flood ({n_f:.0f} calls)")
        result.check(f"RSS after the flood (idle {idle_s:g} s) within {max_rss_after_growth_mib:g} MiB of before",
                     rss_after - rss_before <= max_rss_after_growth_mib * MIB,
                     f"{rss_before / MIB:.0f} -> {rss_after / MIB:.0f} MiB")
        result.check("peak RSS growth during the flood within the budget", flood_peak - rss_before <= budget,
                     f"+{(flood_peak - rss_before) / MIB:.0f} MiB (peak {flood_peak / MIB:.0f} MiB); budget "
                     f"+{budget / MIB:.0f} MiB = normal traffic's +{max(alone_peak - rss_before, 0) / MIB:.0f} + "
                     f"{decoders} decoders x {max_video_decoded_bytes / MIB:g} MiB decoded + {REQUEST_COPIES} x "
                     f"{h.streams} hostile requests x {largest_request / MIB:.1f} MiB + {peak_slack_mib:g}")
        result.check(f"the server drained within {drain_timeout_s:g} s", drained_after is not None,
                     f"{drained_after:.1f} s" if drained_after is not None else "requests still in flight")
        result.check("server alive and SERVING, serves an image and a clip after the flood",
                     server.alive() and serves and _health(server) == "SERVING", serves_detail)
        result.check("no traceback in the server log", "Traceback" not in server.log_text())
        result.figure("scenario_run_s", time.monotonic() - t_begin)
    finally:
        for stop in stops:
            stop.set()
        if rss is not None:
            rss.stop()
        hostile.close()
        if server is not None:
            server.stop()
    return result
