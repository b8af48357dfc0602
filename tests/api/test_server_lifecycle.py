"""The real server under special flags: LRU by bytes, a full queue, cancellation, SIGTERM drain."""

from __future__ import annotations

import signal
import time

import grpc
import numpy as np
import pytest
from encoder_client import EncoderClient
from encoder_client.protocol import encoder_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_queue import BATCHES_STARTED, BIG_GRID, QUEUE, in_thread, one_running_one_queued, patches, request, wait_for

pytestmark = pytest.mark.timeout(180)


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
            # Health says NOT_SERVING once the drain has begun (a call made before the server's loop has
            # taken the signal is an ordinary call, queued behind the big forward).
            def not_serving() -> bool:
                try:
                    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                       timeout=5).status
                    return status == health_pb2.HealthCheckResponse.NOT_SERVING
                except grpc.RpcError as exc:  # the server already stopped taking new calls
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                    return True

            wait_for(not_serving)
            with pytest.raises(grpc.RpcError) as info:
                list(encoder_pb2_grpc.VisionEncoderStub(channel).Encode(
                    request(patches((1, 4, 4), 31)), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        thread.join(120)
    assert "error" not in out, out.get("error")
    (result,) = out["result"]
    assert result.embedding.shape == (4096, 48) and not result.cache_hit
    assert server.proc.wait(60) == 0
    log = server.log_text()
    assert "draining" in log and "stopped" in log and "Traceback" not in log
