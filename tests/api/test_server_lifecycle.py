"""The real server under special flags: LRU by bytes, a full queue, cancellation, SIGTERM drain."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import numpy as np
import pytest
from encoder_client import EncoderClient
from encoder_client.protocol import encoder_pb2 as pb
from encoder_client.protocol import encoder_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.timeout(180)

BIG_GRID = (1, 128, 128)  # 16384 patches: a forward of a second or more on a 2-core CPU
QUEUE = "encoder_service_queue_images"
BATCHES_STARTED = "encoder_service_queue_seconds_count"  # one sample per image entering a forward


def patches(grid, seed: int, dtype=np.float32) -> tuple[np.ndarray, tuple[int, int, int]]:
    rng = np.random.default_rng(seed)
    n = int(np.prod(grid))
    x = rng.integers(0, 256, (n, 1176), dtype=np.uint8) if dtype == np.uint8 else rng.standard_normal((n, 1176))
    return x.astype(dtype), tuple(grid)


def request(*images: tuple[np.ndarray, tuple[int, int, int]]) -> pb.EncodeRequest:
    enum = {np.dtype(np.uint8): pb.DTYPE_UINT8, np.dtype(np.float32): pb.DTYPE_FLOAT32}
    return pb.EncodeRequest(images=[
        pb.Image(patches=pb.Patches(grid_thw=list(g), dtype=enum[x.dtype], data=x.tobytes())) for x, g in images])


def wait_for(condition, timeout_s: float = 30.0, state=None) -> None:
    """Polls ``condition`` until it holds; past ``timeout_s`` fails with ``state()`` (what was seen
    instead), so a CI report says why."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met in {timeout_s:g} s" + (f"; seen: {state()}" if state else ""))
        time.sleep(0.01)


def queue_state(server, threads=()) -> dict:
    """The metrics the queue tests wait on, and how the calls in ``threads`` ended so far."""
    return {"batches_started": server.metric(BATCHES_STARTED), "queue": server.metric(QUEUE),
            "calls": [{k: (repr(v)[:200] if k == "error" else "ok") for k, v in out.items()} for _, out in threads]}


def in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def one_running_one_queued(server, stub, seeds: tuple[int, int]) -> list[tuple[threading.Thread, dict]]:
    """Two big images in separate forwards, the first running and the second waiting in the queue;
    their calls' ``in_thread`` pairs. The second is sent once the first runs (sent together, their
    order is the network's: the second could find the first still queued, and be refused where the
    queue holds one image), built beforehand so that only its send falls within the first's forward."""
    started = server.metric(BATCHES_STARTED)
    first, second = (request(patches(BIG_GRID, seed, np.uint8)) for seed in seeds)
    big = [in_thread(lambda: list(stub.Encode(first, timeout=120)))]
    wait_for(lambda: server.metric(BATCHES_STARTED) == started + 1, state=lambda: queue_state(server, big))
    big.append(in_thread(lambda: list(stub.Encode(second, timeout=120))))
    wait_for(lambda: server.metric(BATCHES_STARTED) == started + 1 and server.metric(QUEUE) == 1,
             state=lambda: queue_state(server, big))
    return big


def test_lru_cache_evicts_by_bytes(start_encoder_server):
    # 16 tokens x 48 x 4 bytes = 3072 bytes per (1, 8, 8) image: 7000 bytes hold two.
    server = start_encoder_server("--cache-bytes", "7000")
    a, b, c = (patches((1, 8, 8), seed) for seed in (1, 2, 3))
    with EncoderClient(server.target, timeout_s=60) as client:
        ra, rb = client.encode([a]), client.encode([b])
        assert client.encode([a])[0].cache_hit  # a is now the most recently used
        rc = client.encode([c])
        hashes = [r[0].content_hash for r in (ra, rb, rc)]
        assert client.lookup(hashes) == [True, False, True]
        assert server.metric("encoder_service_cache_evictions_total") == 1
        forwards = server.metric("encoder_service_forward_batches_total")
        assert not client.encode([b])[0].cache_hit  # evicted: computed again
        assert server.metric("encoder_service_forward_batches_total") == forwards + 1
        # Bigger than the whole cache (40 tokens = 7680 bytes): served, not stored, evicts nothing.
        (big,) = client.encode([patches((1, 8, 20), 4)])
        assert big.embedding.shape == (40, 48)
        assert client.lookup([big.content_hash]) == [False]
        assert server.metric("encoder_service_cache_evictions_total") == 2


def test_full_queue_is_refused_at_once_and_cancel_or_deadline_frees_slots(start_encoder_server):
    server = start_encoder_server("--max-queue-images", "3")
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = encoder_pb2_grpc.VisionEncoderStub(channel)
        encoded_before = server.metric("encoder_service_images_encoded_total")
        big = one_running_one_queued(server, stub, (10, 11))  # one of the three slots taken
        waiting = stub.Encode(request(patches((1, 4, 4), 20), patches((1, 4, 4), 21)), timeout=120)
        wait_for(lambda: server.metric(QUEUE) == 3)

        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Encode(request(patches((1, 4, 4), 22)), timeout=60))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue full" in info.value.details() and "--max-queue-images 3" in info.value.details()
        assert dict(info.value.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"  # may pass later
        # Refused, not admitted later: no slot was awaited. The bound is generous for a loaded CI
        # machine whose cores the running forward keeps busy.
        assert time.monotonic() - t0 < 10.0

        waiting.cancel()  # the client gives up: its two queued images leave the queue
        wait_for(lambda: server.metric(QUEUE) == 1)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Encode(request(patches((1, 4, 4), 23)), timeout=0.5))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: server.metric(QUEUE) == 1)

        for thread, out in big:
            thread.join(120)
            assert "error" not in out and out["result"][-1].last
        assert server.metric(QUEUE) == 0
        # Only the two big images were ever encoded: cancelled and expired ones never ran.
        assert server.metric("encoder_service_images_encoded_total") == encoded_before + 2
        assert list(stub.Encode(request(patches((1, 4, 4), 22)), timeout=60))[-1].last


def test_sigterm_lets_the_running_request_finish_and_exits_0(start_encoder_server):
    server = start_encoder_server()
    started = server.metric(BATCHES_STARTED)
    with EncoderClient(server.target, timeout_s=120, retries=0) as client:
        thread, out = in_thread(lambda: client.encode([patches(BIG_GRID, 30, np.uint8)]))
        wait_for(lambda: server.metric(BATCHES_STARTED) == started + 1)
        server.proc.send_signal(signal.SIGTERM)
        with grpc.insecure_channel(server.target) as channel:
            with pytest.raises(grpc.RpcError) as info:
                list(encoder_pb2_grpc.VisionEncoderStub(channel).Encode(
                    request(patches((1, 4, 4), 31)), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            except grpc.RpcError as exc:  # the server already stopped taking new calls
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
        thread.join(120)
    assert "error" not in out, out.get("error")
    (result,) = out["result"]
    assert result.embedding.shape == (4096, 48) and not result.cache_hit
    assert server.proc.wait(60) == 0
    log = server.log_text()
    assert "draining" in log and "stopped" in log and "Traceback" not in log
