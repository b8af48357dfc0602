"""kill -9 of one of three encoders while a RoutingEncoderClient sends: no request is lost (the
client fails over to each image's next-ranked encoder); the extra latency of the failover is shown
against the latency before the kill."""

from __future__ import annotations

import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from encoder_client import EncoderClientError, RoutingEncoderClient

from ..images import ImageSource
from ..load import Recorder, Sample, mixed_request
from ..result import ScenarioResult
from ..server import ServerSpec, start_server


def _sender(client: RoutingEncoderClient, source: ImageSource, stop: threading.Event, recorder: Recorder,
            seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        kind, images = mixed_request(source, rng, hit_ratio=0.5, max_images=4)
        t = time.monotonic()
        code, detail = "OK", ""
        try:
            results = client.encode(images)
            if len(results) != len(images):
                code, detail = "INCOMPLETE", f"{len(results)} of {len(images)} results"
        except EncoderClientError as err:
            code, detail = err.code.name, err.details
        recorder.add(Sample(t, time.monotonic() - t, code, kind, len(images), detail[:200]))


def run(*, senders: int = 6, before_s: float = 5.0, after_s: float = 6.0, window_s: float = 2.0,
        spec: ServerSpec = ServerSpec(), log_dir=None) -> ScenarioResult:
    result = ScenarioResult("failover")
    with ThreadPoolExecutor(3) as pool:
        servers = list(pool.map(lambda _: start_server("--batch-wait-ms", "0", spec=spec, log_dir=log_dir),
                                range(3)))
    try:
        source = ImageSource(seed=8)
        recorder, stop = Recorder(), threading.Event()
        # A generous health timeout: a busy encoder on a shared 2-core box can take over a second.
        with RoutingEncoderClient([s.target for s in servers], health_interval_s=0.5, health_timeout_s=5.0,
                                  timeout_s=60.0) as client:
            threads = [threading.Thread(target=_sender, args=(client, source, stop, recorder, i), daemon=True)
                       for i in range(senders)]
            for thread in threads:
                thread.start()
            time.sleep(before_s)
            victim = servers[1]
            t_kill = time.monotonic()
            victim.proc.send_signal(signal.SIGKILL)
            time.sleep(after_s)
            stop.set()
            for thread in threads:
                thread.join(120)
            healthy = client.healthy_targets()

        samples = recorder.snapshot()
        lost = [s for s in samples if s.code != "OK"]
        ok = [s for s in samples if s.code == "OK"]
        result.figure("requests", len(samples))
        result.figure("lost", len(lost))
        result.latency("before", [s.seconds for s in ok if t_kill - before_s + 1 <= s.start < t_kill])
        # Failover: calls in flight at the kill or started in the next window_s.
        result.latency("failover", [s.seconds for s in ok if s.end > t_kill and s.start < t_kill + window_s])
        result.latency("after", [s.seconds for s in ok if s.start >= t_kill + window_s])
        result.figure("failover_extra_p50_ms", result.figures["failover_p50_ms"] - result.figures["before_p50_ms"])
        result.figure("failover_extra_p99_ms", result.figures["failover_p99_ms"] - result.figures["before_p99_ms"])

        result.check("no request lost", not lost and len(samples) > 0,
                     "; ".join(f"{s.code}: {s.detail[:100]}" for s in lost[:3]))
        result.check("requests ran across the kill", result.figures["failover_n"] > 0
                     and result.figures["after_n"] > 0)
        result.check("the killed encoder is no longer routed to", victim.target not in healthy, f"{healthy}")
        result.check("the other two stay SERVING", all(s.health() == "SERVING" for s in (servers[0], servers[2])))
    finally:
        for server in servers:
            server.stop()
    return result
