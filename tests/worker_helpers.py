"""A server's device worker processes seen from outside (tests/api/test_server_workers.py, the watchdog's
and the GPU workers' tests): their pids from the log, and one killed under load."""

from __future__ import annotations

import io
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from encoder_client import EncoderClient
from PIL import Image


def png(seed: int, height: int = 112, width: int = 140) -> bytes:
    buffer = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def worker_pids(server) -> dict[str, int]:
    """Device label -> pid of its worker process now (the latest start the log reports)."""
    return {label: int(pid) for label, pid in re.findall(r"worker on (\S+) \(pid (\d+)\)", server.log_text())}


def kill_one_worker_under_load(server, victim_label: str, image_side: int, count: int = 24) -> None:
    """SIGKILLs one worker while clients keep the node loaded; checks that no request is lost (the
    client retries UNAVAILABLE), that the worker comes back and that health never left SERVING."""
    victim = worker_pids(server)[victim_label]
    statuses: list[str] = []
    stop = threading.Event()

    def watch_health():
        while not stop.is_set():
            statuses.append(server.health(timeout_s=5.0))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_health, daemon=True)
    watcher.start()
    images = [png(2000 + i, image_side, image_side) for i in range(count)]
    try:
        with EncoderClient(server.target, retries=8, timeout_s=120) as client, ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(lambda image: client.encode([image])[0], image) for image in images]
            deadline = time.monotonic() + 30
            while server.metric("encoder_service_forward_batches_total", f'device="{victim_label}"') < 1:
                assert time.monotonic() < deadline, f"worker {victim_label} never ran a forward"
                time.sleep(0.005)
            os.kill(victim, signal.SIGKILL)
            results = [f.result() for f in futures]  # raises if any request was lost
        assert len({r.content_hash for r in results}) == len(images)
        deadline = time.monotonic() + 120
        while (worker_pids(server)[victim_label] == victim
               or server.metric("encoder_service_workers_up", f'device="{victim_label}"') != 1):
            assert time.monotonic() < deadline, "the killed worker did not come back"
            time.sleep(0.1)
    finally:
        stop.set()
        watcher.join()
    assert statuses and set(statuses) == {"SERVING"}, statuses
    assert server.metric("encoder_service_worker_restarts_total", f'device="{victim_label}"') == 1
    assert f"worker on {victim_label} died" in server.log_text()
    with EncoderClient(server.target) as client:  # the node, restarted worker included, serves on
        assert len(client.encode([png(3000 + i) for i in range(4)])) == 4
