"""Pushing embeddings to an EmbeddingSink: allowed targets only, retries, per-request failure, and
the receiver a decode server mounts (reassembly, awaitables, byte bound, cleanup)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import ml_dtypes
import numpy as np
import pytest
from encoder_client import EncoderClient, EncoderClientError
from encoder_client.protocol import encoder_pb2, encoder_pb2_grpc

from encoder_service.benchmarks.reliability.sinks import SinkServer, receiver

GRID = (1, 8, 8)

# The same tests against two worker processes (--devices cpu,cpu): conftest.pytest_generate_tests.
ALSO_WITH_WORKER_PROCESSES = True
ALSO_WITH_GRPC_PROCESSES = True



def patches(seed: int, grid=GRID) -> tuple[np.ndarray, tuple[int, int, int]]:
    n = int(np.prod(grid))
    return np.random.default_rng(seed).standard_normal((n, 1176), dtype=np.float32), grid


@pytest.fixture
def sink():
    servers: list[SinkServer] = []

    def start(port: int = 0, **receiver_kwargs) -> SinkServer:
        servers.append(SinkServer(receiver(**receiver_kwargs), port=port))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


SINK_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def sink_encoder(start_encoder_server):
    return start_encoder_server("--allowed-sinks", "127.0.0.1:*", "--max-chunk-bytes", "65536",
                                "--sink-timeout-s", str(SINK_TIMEOUT_S))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sink_metric(server, reason: str) -> float:
    # A pattern's series exists from its first failure on (labels are not created up front).
    return server.metric("encoder_service_sink_push_failures_total", f'pattern="127.0.0.1:*",reason="{reason}"',
                         missing_ok=True)


# --- the encoder side ------------------------------------------------------------------------------


def test_a_sink_outside_allowed_sinks_is_denied_without_a_connection(sink_encoder):
    connects: list[tuple] = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)
    stop = threading.Event()

    def accept_loop():
        while not stop.is_set():
            try:
                conn, addr = listener.accept()
            except TimeoutError:
                continue
            connects.append(addr)
            conn.close()

    thread = threading.Thread(target=accept_loop, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    try:
        with EncoderClient(sink_encoder.target, retries=0) as client:
            # The allowed pattern is 127.0.0.1:*; "localhost" reaches the same socket but is not allowed.
            for target in (f"localhost:{port}", f"dns:///127.0.0.1:{port}", f"127.0.0.1:{port}/x"):
                with pytest.raises(EncoderClientError) as exc:
                    client.encode_to_sink([patches(0)], target, sink_request_id="r")
                assert exc.value.code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
            with pytest.raises(EncoderClientError) as exc:
                client.encode_to_sink([patches(0)], f"localhost:{port}", sink_request_id="r")
            assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert f"localhost:{port}" in exc.value.details and "--allowed-sinks" in exc.value.details
        time.sleep(0.5)
        assert connects == []
    finally:
        stop.set()
        thread.join(2)
        listener.close()


def test_pushed_embeddings_equal_the_streamed_ones(sink_encoder, sink):
    s = sink()
    images = [patches(1), patches(2, (1, 4, 6)), patches(1)]  # the third repeats the first
    with EncoderClient(sink_encoder.target) as client:
        streamed = client.encode(images)
        headers = client.encode_to_sink(images, s.target, sink_request_id="same-as-stream",
                                        max_chunk_bytes=4096)  # several chunks per image
    received = s.wait("same-as-stream")
    assert [h.index for h in headers] == [0, 1, 2]
    assert all(h.cache_hit for h in headers)  # the streamed request cached them
    for h, got, want in zip(headers, received, streamed, strict=True):
        assert (h.content_hash, h.num_tokens, h.grid_thw) == (want.content_hash, want.num_tokens, want.grid_thw)
        np.testing.assert_array_equal(got.embedding, want.embedding)
    assert s.receiver.pending_requests == 0 and s.receiver.buffered_bytes == 0


def test_a_sink_that_stays_down_fails_only_its_request_with_unavailable(sink_encoder):
    down = f"127.0.0.1:{free_port()}"
    # A closed port answers each connect with a refusal (unavailable); on a busy host the last try may
    # still be connecting when the bound runs out (deadline). Either is this one push's failure.
    reasons = ("unavailable", "deadline")
    before = sum(sink_metric(sink_encoder, r) for r in reasons)
    with EncoderClient(sink_encoder.target, retries=0) as client, ThreadPoolExecutor(2) as pool:
        failing = pool.submit(client.encode_to_sink, [patches(3)], down, sink_request_id="lost")
        others = [client.encode([patches(10 + i)]) for i in range(3)]
        with pytest.raises(EncoderClientError) as exc:
            failing.result(30)
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    assert f"sink {down} did not take the push within {SINK_TIMEOUT_S:g} s" in exc.value.details
    assert all(len(r) == 1 for r in others)
    assert sum(sink_metric(sink_encoder, r) for r in reasons) == before + 1
    assert "127.0.0.1:" not in "".join(line for line in _metrics(sink_encoder) if "sink_push" in line
                                       and 'pattern="127.0.0.1:*"' not in line)


def _metrics(server) -> list[str]:
    return server.metrics_text().splitlines()


class _OtherService:
    """A gRPC server with no EmbeddingSink (health only): it answers a Push with UNIMPLEMENTED at once."""

    def __init__(self) -> None:
        from grpc_health.v1 import health, health_pb2_grpc

        self.server = grpc.server(ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def test_every_sink_failure_is_one_error_after_one_bound_so_ports_cannot_be_scanned(sink_encoder, sink):
    """A closed port, a gRPC server of another kind, a listener that never speaks and a sink that
    refuses the data all look the same to the caller: same code, same words, same time."""
    closed = f"127.0.0.1:{free_port()}"
    other = _OtherService()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections (the kernel does), never answers the HTTP/2 preface
    full = sink(max_buffered_bytes=1000)  # one 16-token x 48 float32 image is 3072 bytes
    targets = {"closed port": closed, "another gRPC service": f"127.0.0.1:{other.port}",
               "silent listener": f"127.0.0.1:{silent.getsockname()[1]}", "full sink": full.target}
    before = {r: sink_metric(sink_encoder, r) for r in ("unavailable", "refused", "deadline")}
    outcomes = {}
    try:
        with EncoderClient(sink_encoder.target, retries=0) as client:
            client.encode([patches(40)])  # cached: the timings below are the sink's alone
            for name, target in targets.items():
                t0 = time.perf_counter()
                with pytest.raises(EncoderClientError) as exc:
                    client.encode_to_sink([patches(40)], target, sink_request_id="scan")
                outcomes[name] = (exc.value.code, exc.value.details.replace(target, "T"), time.perf_counter() - t0)
    finally:
        other.server.stop(0)
        silent.close()
    print({name: f"{o[2]:.2f} s" for name, o in outcomes.items()})
    assert len({(code, details) for code, details, _ in outcomes.values()}) == 1, outcomes
    code, details, _ = next(iter(outcomes.values()))
    assert code == grpc.StatusCode.UNAVAILABLE and "did not take the push" in details
    for name, (_, _, took) in outcomes.items():
        # At least the bound (no failure shows sooner); the upper bound is generous for a loaded CI
        # machine and far below the client's 60 s default deadline that an unbounded push would hit.
        assert SINK_TIMEOUT_S <= took < SINK_TIMEOUT_S + 5, (name, took)
    after = {r: sink_metric(sink_encoder, r) for r in before}
    assert sum(after.values()) - sum(before.values()) == 4  # the reasons are counted, not shown
    assert after["refused"] >= before["refused"] + 2  # UNIMPLEMENTED and RESOURCE_EXHAUSTED
    assert full.receiver.buffered_bytes == 0


def test_a_sink_that_comes_back_within_the_retries_gets_the_push(start_encoder_server, sink):
    # A server of its own with a 5 s bound: the sink is up 0.3 s in, and on a loaded CI machine the
    # connection and the ack after it took the rest of the module's 2 s (its log: "deadline").
    server = start_encoder_server("--allowed-sinks", "127.0.0.1:*", "--sink-timeout-s", "5")
    port = free_port()
    started: list = []
    timer = threading.Timer(0.3, lambda: started.append(sink(port=port)))
    timer.start()
    with EncoderClient(server.target, retries=0) as client:
        headers = client.encode_to_sink([patches(4), patches(5)], f"127.0.0.1:{port}", sink_request_id="late")
    timer.join()
    server.stop()
    assert len(headers) == 2
    assert [im.index for im in started[0].wait("late")] == [0, 1]


def test_a_sink_that_never_acknowledges_is_bounded_by_sink_timeout_without_a_caller_deadline(sink_encoder):
    class Swallow(encoder_pb2_grpc.EmbeddingSinkServicer):
        def Push(self, request_iterator, context):
            for _ in request_iterator:  # reads everything, then holds the call open
                pass
            time.sleep(30)

    server = grpc.server(ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
    encoder_pb2_grpc.add_EmbeddingSinkServicer_to_server(Swallow(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    before = sink_metric(sink_encoder, "deadline")
    try:
        with EncoderClient(sink_encoder.target, retries=0, timeout_s=None) as client:
            t0 = time.perf_counter()
            with pytest.raises(EncoderClientError) as exc:
                client.encode_to_sink([patches(6)], f"127.0.0.1:{port}", sink_request_id="never-acked")
            took = time.perf_counter() - t0
    finally:
        server.stop(0)
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE and took < SINK_TIMEOUT_S + 8, took  # the sink holds 30 s
    assert sink_metric(sink_encoder, "deadline") == before + 1
    assert sink_encoder.metric("encoder_service_requests_in_flight") == 0


# --- the receiver alone ------------------------------------------------------------------------------


def chunk(request_id: str, index: int, num_images: int, rows: np.ndarray, offset: int = 0, last: bool = True):
    return encoder_pb2.EmbeddingChunk(
        request_id=request_id, image_index=index, num_images=num_images, content_hash=f"h{index}",
        grid_thw=[1, 4, 4], num_tokens=4, hidden_size=rows.shape[1], dtype=encoder_pb2.DTYPE_FLOAT32,
        token_offset=offset, data=rows.astype("<f4").tobytes(), last=last)


def push(target: str, chunks) -> encoder_pb2.PushAck:
    with grpc.insecure_channel(target) as channel:
        return encoder_pb2_grpc.EmbeddingSinkStub(channel).Push(iter(chunks), timeout=10)


def test_receiver_resolves_each_image_and_the_request_and_restarts_a_retried_push(sink):
    s = sink()
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    b = -a

    async def expect():
        return s.receiver.expect("r1")

    pending = s.call(expect())
    first = asyncio.run_coroutine_threadsafe(pending.image(1), s.loop)
    # A push that ends after image 1 and half of image 0: refused, the request stays pending.
    with pytest.raises(grpc.RpcError) as exc:
        push(s.target, [chunk("r1", 1, 2, b), chunk("r1", 0, 2, a[:2], last=False)])
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1 of 2 images" in exc.value.details()
    np.testing.assert_array_equal(first.result(5).embedding, b)  # image 1 was complete: resolved already
    # The encoder's retry sends everything again; image 0 is reassembled from scratch.
    ack = push(s.target, [chunk("r1", 0, 2, a[:2], last=False), chunk("r1", 1, 2, b),
                          chunk("r1", 0, 2, a[2:], offset=2)])
    assert ack.images == 2
    images = s.wait("r1")
    np.testing.assert_array_equal(images[0].embedding, a)
    np.testing.assert_array_equal(images[1].embedding, b)
    assert s.receiver.buffered_bytes == 0


def test_receiver_returns_bf16_as_bfloat16_by_default_float32_or_bits_when_asked(sink):
    values = np.arange(16, dtype=np.float32).reshape(4, 4) / 8  # exact in bf16
    bits = values.view(np.uint32) >> 16
    bf16 = encoder_pb2.EmbeddingChunk(
        request_id="r", image_index=0, num_images=1, content_hash="h0", grid_thw=[1, 4, 4], num_tokens=4,
        hidden_size=4, dtype=encoder_pb2.DTYPE_BFLOAT16, data=bits.astype("<u2").tobytes(), last=True)
    for bf16_as, dtype, held, want in ((None, ml_dtypes.bfloat16, 32, values), ("float32", np.float32, 64, values),
                                       ("uint16", np.uint16, 32, bits)):
        s = sink(**({} if bf16_as is None else {"bf16_as": bf16_as}))
        push(s.target, [bf16])
        assert s.receiver.buffered_bytes == held  # what the receiver holds: 2 bytes a value unless widened
        (image,) = s.wait("r")
        assert image.dtype == "bfloat16" and image.embedding.dtype == dtype
        np.testing.assert_array_equal(image.embedding.astype(want.dtype), want)
    with pytest.raises(ValueError, match="bf16_as"):
        receiver(bf16_as="float16")()


def test_receiver_drops_abandoned_requests_and_frees_their_bytes(sink):
    # Held until 2 s after its chunk came: long enough to be seen held on a loaded machine.
    s = sink(request_timeout_s=2.0)
    push(s.target, [chunk("nobody-waits", 0, 1, np.ones((4, 4), np.float32))])
    assert s.receiver.buffered_bytes == 64
    deadline = time.monotonic() + 10
    while s.receiver.pending_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.receiver.pending_requests == 0 and s.receiver.buffered_bytes == 0
    with pytest.raises(EncoderClientError) as exc:
        s.wait("never-pushed", timeout_s=0.2)
    assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_receiver_refuses_chunks_without_request_id_or_image_count(sink):
    s = sink()
    for bad in (chunk("", 0, 1, np.ones((4, 4), np.float32)), chunk("r", 0, 0, np.ones((4, 4), np.float32))):
        with pytest.raises(grpc.RpcError) as exc:
            push(s.target, [bad])
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_sink_channels_close_when_idle_and_stay_few_however_many_targets_callers_name():
    from encoder_service.api.sink_push import SinkChannels

    async def run():
        channels = SinkChannels(1 << 20, idle_close_s=0.2, max_channels=3)
        held = channels.acquire("127.0.0.1:1")  # in use: never closed under a push
        for port in range(2, 12):
            channels.acquire(f"127.0.0.1:{port}")
            channels.release(f"127.0.0.1:{port}")
            assert len(channels) <= 3
        await asyncio.sleep(0.3)
        channels.acquire("127.0.0.1:50")  # any use prunes: the idle ones go, the held one stays
        assert len(channels) == 2 and channels.acquire("127.0.0.1:1") is held
        await channels.close()
        assert len(channels) == 0

    asyncio.run(run())
