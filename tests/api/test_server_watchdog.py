"""--watchdog-timeout-s on a real server: a worker process that stops making progress with requests
waiting (SIGSTOP: alive, but answering nothing) turns health NOT_SERVING and the stalled gauge on;
once it runs again (SIGCONT), SERVING again and every waiting request completes."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from encoder_client import EncoderClient
from worker_helpers import png, worker_pids

pytestmark = pytest.mark.timeout(240)

TIMEOUT_S = 1.5
STALLED = "encoder_service_worker_stalled"


def wait_for_health(server, status: str, timeout_s: float) -> float:
    """Seconds until health said ``status``; fails after timeout_s."""
    started = time.monotonic()
    while server.health(timeout_s=5.0) != status:
        assert time.monotonic() - started < timeout_s, f"health not {status} after {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_stopped_worker_with_requests_waiting_turns_health_not_serving_until_it_runs_again(start_encoder_server):
    server = start_encoder_server("--devices", "cpu", "--watchdog-timeout-s", str(TIMEOUT_S), "--batch-wait-ms", "0")
    worker = worker_pids(server)["cpu:0"]
    assert server.metric(STALLED, 'device="cpu:0"') == 0
    images = [png(5000 + i) for i in range(6)]
    os.kill(worker, signal.SIGSTOP)
    try:
        with EncoderClient(server.target, timeout_s=120, retries=0) as client, ThreadPoolExecutor(3) as pool:
            sent = time.monotonic()
            futures = [pool.submit(lambda image: client.encode([image])[0], image) for image in images]
            wait_for_health(server, "NOT_SERVING", timeout_s=TIMEOUT_S + 30)
            stalled_after = time.monotonic() - sent
            # Not before the timeout: a worker busy with a batch is no stall until then.
            assert stalled_after >= TIMEOUT_S, stalled_after
            assert server.metric(STALLED, 'device="cpu:0"') == 1
            assert server.metric("encoder_service_workers_up", 'device="cpu:0"') == 1  # alive, not progressing
            assert not any(f.done() for f in futures)

            os.kill(worker, signal.SIGCONT)
            wait_for_health(server, "SERVING", timeout_s=30)
            results = [f.result(timeout=60) for f in futures]
    finally:
        os.kill(worker, signal.SIGCONT)  # whatever failed above, leave no stopped process behind
    assert sorted(r.content_hash for r in results) == sorted({r.content_hash for r in results})
    assert all(r.num_tokens > 0 and not r.cache_hit for r in results)
    assert server.metric(STALLED, 'device="cpu:0"') == 0
    assert worker_pids(server)["cpu:0"] == worker  # the same process: nothing was restarted
    log = server.log_text()
    assert f"has completed no forward for over {TIMEOUT_S:g} s" in log and "makes progress again" in log
