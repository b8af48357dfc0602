"""The video path's audit, against a real server process (real gRPC, real clips made with PyAV), with
the default flags: what one caller's hostile or heavy video can make the server do to everyone else.

The bar (the audit's issue): no single request, and no pair of cancelled requests, makes another
caller's ordinary image or clip wait more than 3 s beyond its own work; over-limit input is refused
RESOURCE_EXHAUSTED (never INTERNAL), early, without allocating what it asks for, and freeing what it
took. Each test measures the victim alone first (a warm call, then the median of three), then under
the attack, calling again and again while it runs (an attack's cost comes in phases: one call could
miss the worst of it), on a server of its own.

"Another caller": the server tells clients apart (--max-requests-per-client, the fair turns) by their
bearer token where it checks tokens, else by their peer's IP address, and requests apart within a
client. On one host every client connects from 127.0.0.1, whatever 127.x address it dials, and ::1 is
not on every host; so the servers here check tokens (``--auth-token-file``, their one flag besides
the defaults) and the attacker and the victim present different ones: two clients on any host.

Every call has a deadline and every wait a bound; a server left decoding by a failed test is killed,
its decoder processes with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import struct
import threading
import time
import zlib
from dataclasses import dataclass

import grpc
import pytest
from encoder_client import Video
from encoder_client.protocol import encoder_pb2 as pb
from encoder_client.protocol import encoder_pb2_grpc

from encoder_service.benchmarks.reliability.images import base_picture, encode_picture
from encoder_service.benchmarks.reliability.server import EncoderProcess, start_server, wait_until
from encoder_service.benchmarks.reliability.video_inputs import (
    big_png,
    decode_bomb,
    frame_pattern,
    make_clip,
    tiny_gif,
)

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(150)]

MAX_EXTRA_WAIT_S = 3.0  # the bound on what another caller's input may add to a victim's latency
VICTIM_SLACK_S = 7.0  # a victim's deadline under attack: alone + the bound + this (a failure, not a hang)
MiB = 1 << 20
BAD_CODES = ("INTERNAL", "UNKNOWN")
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * MiB), ("grpc.max_send_message_length", -1)]


# --- calls ---------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    code: str  # "OK" or a grpc.StatusCode name
    seconds: float
    details: str = ""
    pushback_ms: int | None = None  # grpc-retry-pushback-ms, where the server sent one

    def __str__(self) -> str:
        hint = f" (pushback {self.pushback_ms} ms)" if self.pushback_ms is not None else ""
        return f"{self.code} after {self.seconds:.2f} s{hint}{': ' + self.details[:300] if self.details else ''}"


class Caller:
    """One client connection (one channel) to ``target``."""

    def __init__(self, target: str, token: str) -> None:
        self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.stub = encoder_pb2_grpc.VisionEncoderStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),)  # who this client is to the server

    def close(self) -> None:
        self.channel.close()

    def call(self, items: list, timeout_s: float, cancel_after_s: float | None = None,
             calls: list | None = None) -> Outcome:
        """One Encode of ``items`` (image bytes or Video), read to its end. ``cancel_after_s``: the
        client cancels the call then (as a caller that goes away does). ``calls``: the call is
        appended to it (to be cancelled from another thread)."""
        request = pb.EncodeRequest(images=[pb.Image(video=i.to_proto()) if isinstance(i, Video)
                                           else pb.Image(encoded=i) for i in items])
        started = time.monotonic()
        call = self.stub.Encode(request, timeout=timeout_s, metadata=self.metadata)
        if calls is not None:
            calls.append(call)
        timer = threading.Timer(cancel_after_s, call.cancel) if cancel_after_s is not None else None
        if timer is not None:
            timer.start()
        try:
            for _ in call:
                pass
            return Outcome("OK", time.monotonic() - started)
        except grpc.RpcError as err:
            pushback = None
            with contextlib.suppress(Exception):
                for key, value in err.trailing_metadata() or ():
                    if key == "grpc-retry-pushback-ms":
                        pushback = int(value)
            return Outcome(err.code().name, time.monotonic() - started, err.details() or "", pushback)
        finally:
            if timer is not None:
                timer.cancel()

    def start(self, items: list, timeout_s: float, cancel_after_s: float | None = None) -> Pending:
        return Pending(self, items, timeout_s, cancel_after_s)


class Pending(threading.Thread):
    """A call running on a thread of its own; ``outcome()`` waits for it (within its deadline)."""

    def __init__(self, caller: Caller, items: list, timeout_s: float, cancel_after_s: float | None) -> None:
        super().__init__(daemon=True)
        self.args_ = (caller, items, timeout_s, cancel_after_s)
        self.result: Outcome | None = None
        self.calls: list = []
        self.start()

    def run(self) -> None:
        caller, items, timeout_s, cancel_after_s = self.args_
        self.result = caller.call(items, timeout_s, cancel_after_s, self.calls)

    def cancel(self) -> None:
        """Cancels the call if it is still running (the attack has done what it was measured for)."""
        if wait_until(lambda: self.calls or not self.is_alive(), 5.0) is not None:
            for call in self.calls:
                call.cancel()

    def outcome(self) -> Outcome:
        self.join(self.args_[2] + 10)
        assert self.result is not None, "a call outlived its own deadline by 10 s"
        return self.result


# --- servers -------------------------------------------------------------------------------------------

@dataclass
class Served:
    server: EncoderProcess
    attacker: Caller  # one client (its token)
    victim: Caller  # another client (another token)


@contextlib.contextmanager
def serving(tmp_path, *flags: str):
    """A server with the default flags (and ``flags``) but for its tokens, one for the attacker and one
    for the victim; killed afterwards with its decoders."""
    tokens = tmp_path / "tokens"
    tokens.write_text("attacker-token\nvictim-token\n")
    server = start_server("--auth-token-file", str(tokens), *flags, log_dir=tmp_path, timeout_s=120)
    attacker, victim = Caller(server.target, "attacker-token"), Caller(server.target, "victim-token")
    try:
        yield Served(server, attacker, victim)
    finally:
        attacker.close()
        victim.close()
        _kill(server)


def _kill(server: EncoderProcess) -> None:
    """Stops the server (SIGTERM, then SIGKILL after 5 s) and kills whatever decoder processes it had: a
    decoder busy with a clip when its server dies would decode on, orphaned, and slow the next test."""
    decoders = server.decoder_pids() if server.alive() else []
    server.stop(signal.SIGTERM, timeout_s=5)
    for pid in decoders:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


# --- inputs --------------------------------------------------------------------------------------------

def small_image(i: int) -> bytes:
    """A plain 448x448 PNG (the tiny preset's max_pixels), different bytes for each i."""
    return encode_picture(base_picture(448, 448, seed=1000 + i), "PNG")


def small_clip(i: int) -> Video:
    """An ordinary clip: 8 frames of 64x48 H.264, all 8 sampled; different bytes for each i."""
    data = make_clip("mp4", "libx264", frames=8, width=64, height=48, fps=10,
                     pattern=lambda n, w, h: frame_pattern(n + 8 * i, w, h))
    return Video(data, num_frames=8)


def tagged_png(png: bytes, serial: int) -> bytes:
    """``png`` with a tEXt chunk holding ``serial`` before its IEND: the same pixels, other bytes (another
    cache entry and job), without encoding the picture again."""
    body = b"tEXt" + b"serial\x00" + str(serial).encode()
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    return png[:-12] + chunk + png[-12:]


def bombs(count: int, frames: int, first: int = 0) -> list[bytes]:
    """``count`` different decode bombs of 1792x1792 (frame counts apart)."""
    return [decode_bomb(frames=frames - first - k) for k in range(count)]


# --- measuring -----------------------------------------------------------------------------------------

def alone_s(served: Served, make, warm: int = 1, runs: int = 3) -> float:
    """The victim's latency with nothing else running: the median of ``runs`` calls of fresh inputs
    (cache misses) after ``warm`` calls that start what a first call starts (decoder processes)."""
    times = []
    for i in range(warm + runs):
        outcome = served.victim.call([make(i)], timeout_s=120)
        assert outcome.code == "OK", f"the victim's input alone: {outcome}"
        if i >= warm:
            times.append(outcome.seconds)
    return statistics.median(times)


PROBE_WINDOW_S = 10.0  # how long the victim keeps calling while an attack runs


def under_attack(served: Served, make, alone: float, until=lambda: False, window_s: float = PROBE_WINDOW_S,
                 serial: int = 100) -> tuple[Outcome, int]:
    """The victim's calls while an attack runs: one after another, each with a deadline past the bound
    (a failure, not a hang), from now until ``until()`` holds or ``window_s`` has passed (at least
    one call). An attack's cost comes in phases (the decode, then the resize or the forwards), so one
    call could miss the worst of it. Returns the worst call (the first one over the bound or failed,
    else the slowest) and the number of calls."""
    worst: Outcome | None = None
    started, calls = time.monotonic(), 0
    while calls == 0 or (not until() and time.monotonic() - started < window_s):
        outcome = served.victim.call([make(serial + calls)], timeout_s=alone + MAX_EXTRA_WAIT_S + VICTIM_SLACK_S)
        calls += 1
        if outcome.code != "OK" or outcome.seconds - alone > MAX_EXTRA_WAIT_S:
            return outcome, calls
        if worst is None or outcome.seconds > worst.seconds:
            worst = outcome
        time.sleep(0.05)
    assert worst is not None
    return worst, calls


def finished(*pending: Pending):
    return lambda: not any(p.is_alive() for p in pending)


def victim_failures(name: str, alone: float, attacked: Outcome) -> list[str]:
    if attacked.code != "OK":
        return [f"{name}: the victim's call failed under attack ({attacked}); alone it took {alone:.2f} s"]
    extra = attacked.seconds - alone
    if extra > MAX_EXTRA_WAIT_S:
        return [f"{name}: the victim waited {extra:.2f} s beyond its own work ({attacked.seconds:.2f} s under "
                f"attack, {alone:.2f} s alone), over the bound of {MAX_EXTRA_WAIT_S:g} s"]
    return []


def internal_failures(outcomes: dict[str, Outcome]) -> list[str]:
    return [f"{name}: {o}" for name, o in outcomes.items() if o.code in BAD_CODES]


def cpu_by_process(server: EncoderProcess) -> dict[object, float]:
    """CPU seconds so far of the server process and of each decoder process alive now."""
    return {"server": server.cpu_s(), **server.decoders_cpu_s()}


def cpu_between(before: dict, after: dict) -> float:
    """CPU seconds used between two snapshots (a decoder started in between counts from 0; one that
    ended in between is not seen after, and counts nothing)."""
    return sum(value - before.get(key, 0.0) for key, value in after.items())


def report(record_property, figures: dict) -> None:
    print()
    for key, value in figures.items():
        print(f"  {key}: {value}")
        record_property(key, value if isinstance(value, (int, float)) else str(value))


def check(failures: list[str], figures: dict) -> None:
    assert not failures, "\n".join(failures) + "\n\nfigures: " + ", ".join(f"{k}={v}" for k, v in figures.items())


# --- 1. the decode bomb ---------------------------------------------------------------------------------

def test_a_decode_bomb_is_refused_early_naming_its_flag_and_holds_no_one_else_up(tmp_path, record_property):
    # The audit's bomb: 1792x1792 VP9, 18000 frames (one key frame, the rest empty), 0.8 MB. Two of them
    # in one request, 2 frames sampled each: decoding reaches frame 9000 of each, on both decoder
    # processes (the CPU's default), for up to --max-video-decode-seconds (60 s).
    attack = [Video(decode_bomb(), num_frames=2), Video(decode_bomb(frames=17999), num_frames=2)]
    with serving(tmp_path) as served:
        alone = alone_s(served, small_clip)
        bomb = served.attacker.start(attack, timeout_s=20)
        time.sleep(1.0)  # both bombs on the decoders
        attacked, calls = under_attack(served, small_clip, alone, until=finished(bomb))
        refused = bomb.outcome()
    figures = {"victim_clip_alone_s": round(alone, 3), "victim_clip_attacked_s": round(attacked.seconds, 3),
               "victim_clip_attacked": attacked.code, "victim_calls": calls, "bomb": str(refused)}
    report(record_property, figures)
    failures = victim_failures("an ordinary clip beside a decode bomb", alone, attacked)
    if refused.code != "RESOURCE_EXHAUSTED" or refused.seconds > 15.0:
        failures.append(f"the decode bomb was not refused RESOURCE_EXHAUSTED within 15 s: {refused}")
    elif "--max-video-pixels-per-sample" not in refused.details:
        failures.append(f"the decode bomb's refusal does not name --max-video-pixels-per-sample: {refused}")
    failures += internal_failures({"bomb": refused, "victim": attacked})
    check(failures, figures)


# --- 2. cancelled requests withdraw their clips ----------------------------------------------------------

def test_cancelled_requests_of_decode_bombs_stop_decoding_and_hold_no_one_else_up(tmp_path, record_property):
    # Two requests of 8 bombs each: one cancelled by its client half a second after sending, one
    # running out of its 1 s deadline. Nobody waits for their clips: the decoders must drop them.
    first, second = bombs(8, frames=6000), bombs(8, frames=6000, first=8)
    with serving(tmp_path) as served:
        alone = alone_s(served, small_clip)
        cpu_before = cpu_by_process(served.server)
        cancelled = served.attacker.start([Video(b, num_frames=2) for b in first], timeout_s=30, cancel_after_s=0.5)
        expired = served.attacker.start([Video(b, num_frames=2) for b in second], timeout_s=1.0)
        gave_up = [cancelled.outcome(), expired.outcome()]
        given_up_at = time.monotonic()
        attacked, calls = under_attack(served, small_clip, alone, window_s=3.0)
        # The decoders must be idle within 3 s of the callers leaving: the CPU of the server and its
        # decoders over one second from then (or from the victim's last call's end, if later).
        time.sleep(max(0.0, given_up_at + 3.0 - time.monotonic()))
        window_start = cpu_by_process(served.server)
        time.sleep(1.0)
        idle_cpu = cpu_between(window_start, cpu_by_process(served.server))
        total_cpu = cpu_between(cpu_before, cpu_by_process(served.server))
    figures = {"victim_clip_alone_s": round(alone, 3), "victim_clip_attacked_s": round(attacked.seconds, 3),
               "victim_clip_attacked": attacked.code, "victim_calls": calls,
               "cancelled": str(gave_up[0]), "expired": str(gave_up[1]),
               "cpu_s_in_1s_from_3s_after": round(idle_cpu, 2), "cpu_s_total": round(total_cpu, 2)}
    report(record_property, figures)
    failures = victim_failures("an ordinary clip after two cancelled requests of bombs", alone, attacked)
    if idle_cpu > 0.3:
        failures.append(f"3 s after their callers left, the server and its decoders still used {idle_cpu:.2f} CPU "
                        "seconds in one second: the given-up clips are still being decoded")
    failures += internal_failures({"cancelled": gave_up[0], "expired": gave_up[1], "victim": attacked})
    check(failures, figures)


# --- 3. bounded waiting -----------------------------------------------------------------------------------

def test_many_clips_from_one_client_are_refused_with_a_retry_hint_not_queued_without_bound(tmp_path,
                                                                                          record_property):
    # 40 bombs in 5 requests of 8, all at once, from one client: more than the decoders should let
    # wait. Some must be refused RESOURCE_EXHAUSTED with a retry hint (grpc-retry-pushback-ms >= 0).
    clips = bombs(40, frames=6000, first=100)
    with serving(tmp_path) as served:
        served.attacker.call([small_clip(0)], timeout_s=120)  # decoders started
        calls = [served.attacker.start([Video(b, num_frames=2) for b in clips[8 * r:8 * r + 8]], timeout_s=10)
                 for r in range(5)]
        outcomes = {f"request {r}": call.outcome() for r, call in enumerate(calls)}
    figures = {name: str(o) for name, o in outcomes.items()}
    report(record_property, figures)
    failures = []
    hinted = [o for o in outcomes.values() if o.code == "RESOURCE_EXHAUSTED" and (o.pushback_ms or -1) >= 0]
    if not hinted:
        failures.append("none of 5 requests of 8 bombs (40 clips at once from one client) was refused "
                        "RESOURCE_EXHAUSTED with a retry hint (grpc-retry-pushback-ms >= 0): "
                        + "; ".join(f"{k}: {v}" for k, v in outcomes.items()))
    failures += internal_failures(outcomes)
    check(failures, figures)


# --- 4. frames clips don't starve images --------------------------------------------------------------------

FRAMES = 180  # a clip of 180 frames of 1380x1380: 1.03 GB decoded, just under --max-video-decoded-bytes


def _frames_clip(serial: int) -> Video:
    png = tagged_png(big_png(1380), serial)
    return Video(frames=[png] * FRAMES, frames_fps=2)  # 2 fps: every frame sampled


@pytest.mark.parametrize("attack", ["2 clips of 180 frames", "8 clips of 180 frames cancelled after 1 s",
                                    "4 clips of 18000 frames of a 1x1 GIF"])
def test_frames_clips_do_not_starve_another_callers_image(tmp_path, record_property, attack):
    with serving(tmp_path) as served:
        alone = alone_s(served, small_image)
        if attack == "2 clips of 180 frames":
            request = [_frames_clip(1), _frames_clip(2)]
            size = pb.EncodeRequest(images=[pb.Image(video=v.to_proto()) for v in request]).ByteSize()
            assert size <= 64 * MiB, f"the attack's request is {size} bytes, over --max-message-bytes"
            pending = [served.attacker.start(request, timeout_s=20)]
        elif attack.startswith("8 clips"):
            pending = [served.attacker.start([_frames_clip(10 + i)], timeout_s=30, cancel_after_s=1.0)
                       for i in range(8)]
        else:
            # vLLM's reference takes every frame given: 18000 frames (--max-video-frames) each decoded and
            # staged, 0.7 MB a clip.
            gifs = [Video(frames=[tiny_gif()] * 18000, frames_fps=1 + i, reference="vllm") for i in range(4)]
            pending = [served.attacker.start(gifs, timeout_s=20)]
        time.sleep(1.5 if attack.startswith("8 clips") else 0.5)
        attacked, calls = under_attack(served, small_image, alone, until=finished(*pending),
                                       window_s=5.0 if attack.startswith("8 clips") else PROBE_WINDOW_S)
        for p in pending:  # measured: what is left of it is not wanted
            p.cancel()
        attacks = {f"attack {i}": p.outcome() for i, p in enumerate(pending)}
    figures = {"victim_image_alone_s": round(alone, 3), "victim_image_attacked_s": round(attacked.seconds, 3),
               "victim_image_attacked": attacked.code, "victim_calls": calls,
               "attacks": "; ".join(f"{k}: {o.code} {o.seconds:.1f} s" for k, o in attacks.items())}
    report(record_property, figures)
    failures = victim_failures(f"a 448x448 image beside {attack}", alone, attacked)
    failures += internal_failures({**attacks, "victim": attacked})
    check(failures, figures)


# --- 5. a caller's pixel bounds allocate nothing ---------------------------------------------------------

MAX_PEAK_GROWTH = 100 * MiB


def _pixel_bounds_request(pixels: int) -> list:
    return [Video(frames=[tiny_gif()] * 4, frames_fps=2, min_pixels=pixels, max_pixels=pixels)]


def test_a_callers_pixel_bounds_are_refused_before_anything_is_allocated(tmp_path, record_property):
    # 4 frames of 1x1, to be resized to min_pixels = max_pixels = 1e8 (then 1e9) pixels each: 148 bytes
    # asking for gigabytes. Refused RESOURCE_EXHAUSTED, the server's peak RSS (VmHWM) not moved.
    figures: dict = {}
    failures: list[str] = []
    outcomes: dict[str, Outcome] = {}
    with serving(tmp_path) as served:
        served.victim.call([Video(frames=[small_image(0)] * 4, frames_fps=2)], timeout_s=120)  # the frames path warm
        for pixels in (10**8, 10**9):
            peak = served.server.peak_rss_bytes()
            outcome = outcomes[f"{pixels:.0e} pixels"] = served.attacker.call(_pixel_bounds_request(pixels),
                                                                              timeout_s=60)
            grown = served.server.peak_rss_bytes() - peak
            figures[f"{pixels:.0e}_pixels"] = str(outcome)
            figures[f"{pixels:.0e}_peak_rss_growth_mib"] = round(grown / MiB, 1)
            if outcome.code != "RESOURCE_EXHAUSTED":
                failures.append(f"min_pixels = max_pixels = {pixels:.0e}: not RESOURCE_EXHAUSTED but {outcome}")
            if grown > MAX_PEAK_GROWTH:
                failures.append(f"min_pixels = max_pixels = {pixels:.0e}: the server's peak RSS grew "
                                f"{grown / MiB:.0f} MiB (bound {MAX_PEAK_GROWTH // MiB} MiB)")
                break  # not 10x more on a shared machine: the finding is shown
        figures["server_alive"] = served.server.alive()
    report(record_property, figures)
    failures += internal_failures(outcomes)
    check(failures, figures)


# --- 6. refusals free what they took ------------------------------------------------------------------------

MAX_RSS_GROWTH = 64 * MiB
HOSTILE_REQUESTS = 14


def _idle_rss(server: EncoderProcess, quiet_s: float = 2.0, timeout_s: float = 20.0) -> int:
    """The server's RSS once it has stayed within 4 MiB for ``quiet_s`` (or after ``timeout_s``)."""
    last, since, started = server.rss_bytes(), time.monotonic(), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() - started < timeout_s:
        time.sleep(0.2)
        now = server.rss_bytes()
        if abs(now - last) > 4 * MiB:
            last, since = now, time.monotonic()
    return server.rss_bytes()


def test_refused_hostile_clips_give_back_the_memory_they_took(tmp_path, record_property):
    # 14 small hostile requests, each refused: 4 frames of 1x1 asking for 1e8 pixels a frame. Once the
    # server is idle again, its RSS is back within 64 MiB of what it was before them.
    outcomes: dict[str, Outcome] = {}
    with serving(tmp_path) as served:
        served.victim.call([Video(frames=[small_image(0)] * 4, frames_fps=2)], timeout_s=120)
        served.victim.call([small_clip(0)], timeout_s=120)
        before = _idle_rss(served.server)
        for i in range(HOSTILE_REQUESTS):
            outcomes[f"hostile {i}"] = served.attacker.call(_pixel_bounds_request(10**8 + i), timeout_s=60)
        after = _idle_rss(served.server)
        peak = served.server.peak_rss_bytes()
    refused = sum(o.code == "RESOURCE_EXHAUSTED" for o in outcomes.values())
    figures = {"rss_before_mib": round(before / MiB, 1), "rss_after_mib": round(after / MiB, 1),
               "rss_growth_mib": round((after - before) / MiB, 1), "peak_rss_mib": round(peak / MiB, 1),
               "refused": refused, "codes": sorted({o.code for o in outcomes.values()}),
               "slowest_s": round(max(o.seconds for o in outcomes.values()), 2)}
    report(record_property, figures)
    failures = []
    if refused != HOSTILE_REQUESTS:
        others = [str(o) for o in outcomes.values() if o.code != "RESOURCE_EXHAUSTED"]
        failures.append(f"{HOSTILE_REQUESTS - refused} of {HOSTILE_REQUESTS} hostile requests not refused "
                        f"RESOURCE_EXHAUSTED: {others[:3]}")
    if after - before > MAX_RSS_GROWTH:
        failures.append(f"after {HOSTILE_REQUESTS} refused requests the server's RSS stayed "
                        f"{(after - before) / MiB:.0f} MiB above what it was before them "
                        f"(bound {MAX_RSS_GROWTH // MiB} MiB)")
    failures += internal_failures(outcomes)
    check(failures, figures)


# --- 7. a flood of large, legal images ----------------------------------------------------------------------

def preprocess_s(served: Served, image: bytes) -> tuple[float, float]:
    """One victim call of ``image``: (its latency, the server's preprocess time for it: from the
    image's arrival at the decode pool, waiting for a thread included, to its decoded pixels), from
    the ServerTiming of its last chunk."""
    started = time.monotonic()
    last = None
    for chunk in served.victim.stub.Encode(pb.EncodeRequest(images=[pb.Image(encoded=image)]), timeout=60,
                                           metadata=served.victim.metadata):
        last = chunk
    return time.monotonic() - started, last.timing.preprocess_ms / 1000.0


def test_a_flood_of_large_images_from_one_client_does_not_starve_another_clients_image_decode(tmp_path,
                                                                                             record_property):
    # 40 requests at once from one client, each of 3 noisy 1380x1380 PNGs (legal: under --max-image-pixels;
    # each decoded, converted and resized down to 448x448 on the server's decode threads). What this
    # checks is the decode threads, the shared pool the issue names: the victim's wait for one, read from
    # the server's own timing. Its forward is shared too: on the CPU preset a batch of the flood's images
    # takes seconds, and images are batched in arrival order (README, threat model), so its end-to-end
    # latency is reported, not bounded here.
    png = big_png(1380)
    with serving(tmp_path) as served:
        preprocess_s(served, small_image(0))  # warm
        alone = sorted(preprocess_s(served, small_image(1 + i)) for i in range(3))[1]
        flood = [served.attacker.start([tagged_png(png, 3 * r + k) for k in range(3)], timeout_s=30)
                 for r in range(40)]
        time.sleep(0.5)
        attacked = []
        while not attacked or (finished(*flood)() is False and len(attacked) < 20):
            attacked.append(preprocess_s(served, small_image(100 + len(attacked))))
        for p in flood:
            p.cancel()
        outcomes = {f"flood {r}": p.outcome() for r, p in enumerate(flood)}
    worst_preprocess = max(a[1] for a in attacked)
    figures = {"victim_preprocess_alone_s": round(alone[1], 3), "victim_preprocess_attacked_worst_s":
               round(worst_preprocess, 3), "victim_latency_alone_s": round(alone[0], 3),
               "victim_latency_attacked_worst_s": round(max(a[0] for a in attacked), 3),
               "victim_calls": len(attacked), "flood_codes": sorted({o.code for o in outcomes.values()})}
    report(record_property, figures)
    failures = []
    if worst_preprocess - alone[1] > MAX_EXTRA_WAIT_S:
        failures.append(f"the victim's image waited {worst_preprocess - alone[1]:.2f} s more for the decode threads "
                        f"than alone, over the bound of {MAX_EXTRA_WAIT_S:g} s")
    failures += internal_failures(outcomes)
    check(failures, figures)
