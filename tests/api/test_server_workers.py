"""``--devices``: one worker process per device behind one front end, on the CPU (``cpu,cpu``).

The same hand-off the GPU node uses (shared memory both ways, workers started with spawn, restart
of a dead worker) runs here on every push; the GPU figures and the one-process-per-GPU check are
``gpu`` tests (tests/gpu/test_gpu_workers.py).
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from encoder_client import EncoderClient
from worker_helpers import kill_one_worker_under_load, png, worker_pids

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def two_workers(start_encoder_server):
    return start_encoder_server("--devices", "cpu,cpu", "--max-batch-tokens", "4096", "--batch-wait-ms", "0")


@pytest.fixture(scope="module")
def in_process(start_encoder_server):
    return start_encoder_server("--max-batch-tokens", "4096", "--batch-wait-ms", "0")


def test_workers_start_as_processes_of_their_own_and_the_model_says_where_it_runs(two_workers):
    pids = worker_pids(two_workers)
    assert set(pids) == {"cpu:0", "cpu:1"}
    assert len(set(pids.values())) == 2 and two_workers.pid not in pids.values()
    for pid in pids.values():
        os.kill(pid, 0)  # alive
    with EncoderClient(two_workers.target) as client:
        assert client.model_info().device == "cpu:0,cpu:1"
    assert two_workers.metric("encoder_service_workers_up", 'device="cpu:0"') == 1
    assert two_workers.metric("encoder_service_workers_up", 'device="cpu:1"') == 1


def test_embeddings_through_worker_processes_equal_the_in_process_server(two_workers, in_process):
    images = [png(seed, 84 + 28 * (seed % 3), 112) for seed in range(6)]
    rng = np.random.default_rng(7)
    patches = (rng.standard_normal((64, 1176)).astype(np.float32), (1, 8, 8))
    with EncoderClient(two_workers.target) as a, EncoderClient(in_process.target) as b:
        got = a.encode([*images, patches])
        want = b.encode([*images, patches])
        assert a.model_info().cache_namespace == b.model_info().cache_namespace
    for g, w in zip(got, want):
        assert g.content_hash == w.content_hash and g.grid_thw == w.grid_thw
        # float32 on CPU: the two servers' forwards run different batches on different thread
        # counts, so oneDNN sums in a different order (element-wise differences of ~1e-6 seen on
        # small values); a hand-off that moved or dropped rows would be far off.
        assert np.linalg.norm(g.embedding - w.embedding) <= 1e-5 * np.linalg.norm(w.embedding)


def test_a_kimi_clip_through_a_worker_process_equals_the_model_in_process(start_encoder_server):
    # Kimi-K2.5 averages a clip's frames: its token count does not grow with t, and the hand-off
    # must size and split the embeddings by the model's count, not by t * h * w.
    from encoder_service.models import load_vision_model

    server = start_encoder_server("--model", "tiny-kimi-k2.5", "--devices", "cpu")
    model = load_vision_model("tiny-kimi-k2.5")
    grids = [(2, 4, 6), (1, 4, 4), (3, 2, 2)]
    rng = np.random.default_rng(3)
    clips = [(rng.standard_normal((t * h * w, model.spec.patch_dim)).astype(np.float32), (t, h, w))
             for t, h, w in grids]
    with EncoderClient(server.target) as client:
        got = client.encode(clips)
    want = [model.encode(pixels, [grid])[0].numpy() for pixels, grid in clips]
    for g, w, (_t, h, w_) in zip(got, want, grids):
        assert g.embedding.shape == (h * w_ // 4, model.spec.hidden_size)
        np.testing.assert_allclose(g.embedding, w, rtol=1e-5, atol=1e-6)


def test_concurrent_load_is_spread_over_both_workers(two_workers):
    before = {d: two_workers.metric("encoder_service_forward_batches_total", f'device="{d}"')
              for d in ("cpu:0", "cpu:1")}
    images = [png(1000 + i, 224, 224) for i in range(24)]
    with EncoderClient(two_workers.target) as client, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda image: client.encode([image])[0], images))
    assert len({r.content_hash for r in results}) == len(images)
    for device, count in before.items():
        assert two_workers.metric("encoder_service_forward_batches_total", f'device="{device}"') > count, device


def test_a_killed_worker_loses_no_request_and_comes_back_while_the_node_keeps_serving(start_encoder_server):
    server = start_encoder_server("--devices", "cpu,cpu", "--max-batch-tokens", "16384", "--batch-wait-ms", "0")
    # Images large enough that a forward takes a while: the kill lands inside one.
    kill_one_worker_under_load(server, "cpu:1", image_side=896)


def test_a_node_whose_only_worker_died_is_not_serving_until_it_is_back(start_encoder_server):
    server = start_encoder_server("--devices", "cpu")
    victim = worker_pids(server)["cpu:0"]
    os.kill(victim, signal.SIGKILL)
    seen = set()
    deadline = time.monotonic() + 60
    while True:
        status = server.health(timeout_s=5.0)
        seen.add(status)
        if status == "SERVING" and worker_pids(server)["cpu:0"] != victim:
            break
        assert time.monotonic() < deadline, f"never SERVING again; saw {seen}"
        time.sleep(0.02)
    assert "NOT_SERVING" in seen
    with EncoderClient(server.target) as client:
        assert len(client.encode([png(4000)])) == 1
