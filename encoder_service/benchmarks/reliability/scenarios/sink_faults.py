"""Sink faults: sinks that are down, slow (backpressure), flapping, or acknowledging wrongly (or never).

The contract (--sink-timeout-s): every push is bounded by the sink timeout and by the caller's
deadline, and every failure toward a sink is answered UNAVAILABLE with one message after one bound,
whatever the fault (so a broad allowlist is no port-scan oracle). Meanwhile the encoder stays
healthy and serves other callers, nothing stays in flight, and memory stays bounded.
"""

from __future__ import annotations

import random
import socket
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from itertools import count

from encoder_client import EncoderClient, EncoderClientError

from ..images import ImageSource
from ..load import Recorder, Sample, mixed_request
from ..result import ScenarioResult
from ..server import IN_FLIGHT, ServerSpec, start_server, wait_until
from ..sinks import NeverAck, SinkServer, SlowReader, WrongAck, receiver

_ids = count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _push(target: str, sink: str, image: bytes, timeout_s: float) -> tuple[str, str, float]:
    """(code, details with the sink's address masked, seconds) of one sink-bound Encode."""
    t = time.monotonic()
    with EncoderClient(target, timeout_s=timeout_s, retries=0) as client:
        try:
            # The smallest chunks: a 448x448 image's embedding is a dozen pushed messages.
            client.encode_to_sink([image], sink, sink_request_id=f"r{next(_ids)}", max_chunk_bytes=4096)
            return "OK", "", time.monotonic() - t
        except EncoderClientError as err:
            return err.code.name, err.details.replace(sink, "<sink>"), time.monotonic() - t


def _other_callers(target: str, stop: threading.Event, recorder: Recorder) -> None:
    source, rng = ImageSource(seed=9, hit_pool=4), random.Random(9)
    with EncoderClient(target, timeout_s=30.0, retries=0) as client:
        while not stop.is_set():
            kind, images = mixed_request(source, rng)
            t = time.monotonic()
            code, detail = "OK", ""
            try:
                client.encode(images)
                if client.health(timeout_s=5.0) != "SERVING":
                    code = "NOT_SERVING"
            except EncoderClientError as err:
                code, detail = err.code.name, err.details
            recorder.add(Sample(t, time.monotonic() - t, code, kind, len(images), detail))


def _flap(sink: SinkServer, target: str, image: bytes, timeout_s: float, outages: list[float]) -> list[str]:
    """Pushes one after another while the sink is stopped and started again (same port)."""
    codes: list[str] = []
    stop = threading.Event()

    def pusher():
        while not stop.is_set():
            codes.append(_push(target, sink.target, image, timeout_s)[0])
    thread = threading.Thread(target=pusher, daemon=True)
    thread.start()
    for outage in outages:
        time.sleep(0.5)
        sink.stop()
        time.sleep(outage)
        sink.start()
    time.sleep(0.5)
    stop.set()
    thread.join(60)
    return codes


def run(*, sink_timeout_s: float = 1.0, rounds: int = 3, spec: ServerSpec = ServerSpec(), log_dir=None,
        max_late_s: float = 1.0, max_spread_s: float = 0.5, max_rss_growth_mib: float = 64.0) -> ScenarioResult:
    result = ScenarioResult("sink_faults")
    server = start_server("--allowed-sinks", "127.0.0.1:*", "--sink-timeout-s", str(sink_timeout_s),
                          spec=spec, log_dir=log_dir)
    sinks: dict[str, SinkServer] = {}
    try:
        image = ImageSource(seed=10, sizes=((448, 448),), hit_pool=1).hits[0]
        with EncoderClient(server.target, timeout_s=30.0) as client:
            client.encode([image])  # cached: each push's time is the sink's, not the forward's
        sinks = {"ok": SinkServer(receiver()), "backpressure": SinkServer(receiver(max_buffered_bytes=1024)),
                 "slow": SinkServer(lambda: SlowReader(sink_timeout_s / 4)), "wrong_ack": SinkServer(WrongAck),
                 "never_ack": SinkServer(NeverAck), "flapping": SinkServer(receiver())}
        targets = {name: s.target for name, s in sinks.items() if name != "flapping"}
        targets["down"] = f"127.0.0.1:{_free_port()}"
        others, stop_others = Recorder(), threading.Event()
        other_thread = threading.Thread(target=_other_callers, args=(server.target, stop_others, others),
                                        daemon=True)
        other_thread.start()
        # The baseline after the other callers' traffic began: on a GPU its first forwards grow the
        # pinned staging buffers and the libraries' workspaces, which is not what this scenario measures.
        time.sleep(3.0)
        rss_before = server.rss_bytes()
        calls = [(name, t) for _ in range(rounds) for name, t in sorted(targets.items())]
        timeout_s = sink_timeout_s + 10.0
        with ThreadPoolExecutor(len(targets)) as pool:
            outcomes = list(pool.map(lambda c: (c[0], *_push(server.target, c[1], image, timeout_s)), calls))
            # A caller's deadline shorter than the sink timeout bounds the push too.
            deadline = pool.submit(_push, server.target, targets["never_ack"], image, sink_timeout_s / 2)
            flapped = _flap(sinks["flapping"], server.target, image, timeout_s, outages=[0.3, 1.5])
            deadline_code, _, deadline_s = deadline.result()
        after_flap = _push(server.target, sinks["flapping"].target, image, timeout_s)[0]
        stop_others.set()
        other_thread.join(60)
        drained = wait_until(lambda: server.metric(IN_FLIGHT) == 0, 10.0)
        rss_after = server.rss_bytes()

        failures = [o for o in outcomes if o[0] != "ok"]
        for name in sorted(targets):
            mine = [o for o in outcomes if o[0] == name]
            result.figure(f"{name}_s", statistics.median(o[3] for o in mine))
        elapsed = [o[3] for o in failures]
        result.figure("failure_spread_s", max(elapsed) - min(elapsed))
        result.figure("caller_deadline_s", deadline_s)
        result.figure("flapping_pushes", len(flapped))
        result.figure("flapping_ok", flapped.count("OK"))
        result.figure("rss_growth_mib", (rss_after - rss_before) / 2**20)
        result.latency("others", others.latencies())

        ok_codes = [o[1] for o in outcomes if o[0] == "ok"]
        result.check("pushes to a healthy sink succeed", set(ok_codes) == {"OK"}, f"{ok_codes}")
        wrong = sorted({f"{o[0]}: {o[1]}" for o in failures if o[1] != "UNAVAILABLE"})
        result.check("every sink fault is UNAVAILABLE", not wrong, "; ".join(wrong))
        messages = {o[2] for o in failures if o[1] == "UNAVAILABLE"}
        result.check("one message for every sink fault", len(messages) == 1, " | ".join(sorted(messages))[:400])
        early = sorted({o[0] for o in failures if o[3] < sink_timeout_s - 0.05})
        late = sorted({o[0] for o in failures if o[3] > sink_timeout_s + max_late_s})
        result.check(f"every fault answered after the bound ({sink_timeout_s:g} s), none earlier", not early,
                     f"early: {early}")
        result.check(f"none later than the bound + {max_late_s:g} s", not late, f"late: {late}")
        result.check(f"fault timings indistinguishable (spread < {max_spread_s:g} s)",
                     result.figures["failure_spread_s"] < max_spread_s, f"{result.figures['failure_spread_s']:.2f} s")
        result.check("a caller deadline shorter than the sink timeout ends the call at it",
                     deadline_code == "DEADLINE_EXCEEDED" and deadline_s < sink_timeout_s / 2 + 0.5,
                     f"{deadline_code} after {deadline_s:.2f} s")
        result.check("a flapping sink: only OK or UNAVAILABLE, OK again once it is back",
                     set(flapped) <= {"OK", "UNAVAILABLE"} and after_flap == "OK",
                     f"{dict(Counter(flapped))} then {after_flap}")
        bad_others = sorted({f"{s.code}: {s.detail[:80]}" for s in others.snapshot() if s.code != "OK"})
        result.check("other callers served throughout (SERVING, no error)",
                     not bad_others and len(others.snapshot()) > 0, "; ".join(bad_others))
        result.check("nothing stays in flight", drained is not None, f"in flight {server.metric(IN_FLIGHT):.0f}")
        result.check(f"RSS growth < {max_rss_growth_mib:g} MiB", rss_after - rss_before < max_rss_growth_mib * 2**20,
                     f"{(rss_after - rss_before) / 2**20:.1f} MiB")
        result.check("server alive, SERVING, no traceback", server.alive() and server.health() == "SERVING"
                     and "Traceback" not in server.log_text())
    finally:
        for sink in sinks.values():
            sink.close()
        server.stop()
    return result
