"""--grpc-processes: relay processes own the public port and pass every call on to the server
process. A real server with real relay processes; callers see what the server answers, byte for
byte, and the relays live and die with it. (The server tests of test_server_encode,
test_server_errors, test_shared_memory and test_epd_sink also run behind two relays; TLS through a
relay is in test_security_tls.)"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections import Counter

import client_servers
import grpc
import numpy as np
import pytest
from encoder_client import EncoderClient
from encoder_client.protocol import encoder_pb2
from encoder_client.protocol.chunks import parse_chunk
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from encoder_service.api.relay.process import upstream_metadata
from encoder_service.api.relay.regions import RELAY_REGION
from encoder_service.api.security.client_limits import PerClientLimitInterceptor
from encoder_service.benchmarks.reliability.server import wait_until

ENCODE = "/encoder.v1.VisionEncoder/Encode"
SHM_DIR = "/dev/shm"


def png(seed: int, size=(112, 84)) -> bytes:
    return client_servers.png(seed, size)


def relay_pids(server) -> dict[int, int]:
    """Relay index -> pid of the latest start, from the server's log."""
    return {int(i): int(pid) for i, pid in re.findall(r"relay (\d+) \(pid (\d+)\) serving", server.log_text())}


def upstream(server) -> str:
    return re.search(r"relay it to this process's (unix:\S+)", server.log_text()).group(1)


def raw_encode(target: str, request: encoder_pb2.EncodeRequest, **kwargs) -> list[bytes]:
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_stream(ENCODE, request_serializer=None, response_deserializer=None)
        return list(call(request.SerializeToString(), timeout=30, **kwargs))


def without_timing(raw: bytes) -> tuple[bytes, bytes]:
    chunk = parse_chunk(raw)
    header = encoder_pb2.EmbeddingChunk()
    header.CopyFrom(chunk.header)
    header.ClearField("timing")  # how long this call queued: differs call by call
    return header.SerializeToString(), bytes(chunk.data)


@pytest.fixture(scope="module")
def relayed(start_encoder_server):
    return start_encoder_server("--grpc-processes", "2", "--max-batch-tokens", "4096")


def test_streamed_responses_through_a_relay_are_the_chunks_the_server_streams(relayed):
    request = encoder_pb2.EncodeRequest(request_id="same", images=[encoder_pb2.Image(encoded=png(1, (448, 336))),
                                                                   encoder_pb2.Image(encoded=png(2, (56, 56)))],
                                        max_chunk_bytes=5000)
    raw_encode(upstream(relayed), request)  # computed and cached: both calls below are hits
    direct = raw_encode(upstream(relayed), request)
    relayed_chunks = raw_encode(relayed.target, request)
    assert len(direct) > 2  # several chunks an image: the relay cut them as the server does
    assert [without_timing(c) for c in relayed_chunks] == [without_timing(c) for c in direct]
    assert all(parse_chunk(c).HasField("timing") == parse_chunk(c).last for c in relayed_chunks)
    # The relay read them out of its own shared memory: its regions exist while it runs, as
    # descriptors only (memfds): nothing in /dev/shm names them.
    assert relay_regions(relayed)
    assert not named_relay_objects()


def test_every_method_and_status_passes_through(relayed):
    with EncoderClient(relayed.target, timeout_s=10, retries=0) as client:
        assert client.model_info().hidden_size == 48
        assert client.health() == "SERVING"
        (hit,) = client.encode([png(1)])
        assert client.lookup([hit.content_hash, "0" * 64]) == [True, False]
    with grpc.insecure_channel(relayed.target) as channel:
        check = health_pb2.HealthCheckRequest(service="encoder.v1.VisionEncoder")
        health = health_pb2_grpc.HealthStub(channel).Check(check, timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/encoder.v1.VisionEncoder/NoSuchMethod")(b"", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # Reflection: a stream of requests each way (grpcurl lists the services through a relay).
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "encoder.v1.VisionEncoder" in services and "grpc.health.v1.Health" in services
    bad = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=b"not an image")])
    errors = []
    for target in (relayed.target, upstream(relayed)):
        with pytest.raises(grpc.RpcError) as info:
            raw_encode(target, bad)
        errors.append((info.value.code(), info.value.details()))
    assert errors[0] == errors[1] and errors[0][0] == grpc.StatusCode.INVALID_ARGUMENT


def named_relay_objects() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("encoder-relay")}


def relay_regions(server) -> set[tuple[int, int, int]]:
    """(relay pid, inode, bytes) of each region the relays have mapped (their memfds)."""
    regions = set()
    for pid in relay_pids(server).values():
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[5] == "/memfd:encoder-relay":
                    start, stop = (int(x, 16) for x in fields[0].split("-"))
                    regions.add((pid, int(fields[4]), stop - start))
    return regions


def test_a_refused_request_leaves_the_relays_region_to_the_next_call(relayed):
    good = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=png(7))]).SerializeToString()
    bad = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=b"not an image")]).SerializeToString()
    with grpc.insecure_channel(relayed.target) as channel:  # one connection: one relay
        encode = channel.unary_stream(ENCODE, request_serializer=None, response_deserializer=None)
        list(encode(good, timeout=30))
        before = relay_regions(relayed)
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                list(encode(bad, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        list(encode(good, timeout=30))
    # The server answered those calls, so it was done with the region: reused, not replaced.
    assert relay_regions(relayed) == before


def test_the_relays_do_not_load_torch(relayed):
    for pid in relay_pids(relayed).values():
        with open(f"/proc/{pid}/maps") as f:
            assert "libtorch" not in f.read()


def test_per_client_limits_count_the_callers_address_not_the_relay():
    interceptor = PerClientLimitInterceptor(1, by_token=False, relayed=True)

    class Details:
        invocation_metadata = upstream_metadata((("x-encoder-relayed-peer", "forged"), ("k", "v"),
                                                 (RELAY_REGION, "forged 1")), "ipv4:10.1.2.3:5555")

    class Context:
        @staticmethod
        def peer() -> str:
            return "unix:/tmp/encoder-service-x/server.sock"

    assert dict(Details.invocation_metadata)["k"] == "v"
    assert RELAY_REGION not in dict(Details.invocation_metadata)  # only the relay names its regions
    assert interceptor._client(Details, Context) == "client 10.1.2.3"  # what the caller forged is gone


def test_a_killed_relay_is_started_again_and_the_port_serves_throughout(start_encoder_server):
    server = start_encoder_server("--grpc-processes", "2")
    before = relay_pids(server)
    os.kill(before[0], signal.SIGKILL)
    assert wait_until(lambda: relay_pids(server).get(0) not in (None, before[0]), 30) is not None, server.log_text()
    assert f"relay 0 (pid {before[0]}) exited" in server.log_text()
    assert not named_relay_objects()  # its regions died with it: they were descriptors only
    with EncoderClient(server.target, timeout_s=10) as client:  # retries: a connection may have been the dead one's
        assert client.encode([png(3)])[0].num_tokens > 0


def test_sigterm_stops_the_relays_and_leaves_no_socket_or_region(start_encoder_server):
    server = start_encoder_server("--grpc-processes", "2")
    with EncoderClient(server.target, timeout_s=10, retries=0) as client:
        client.encode([png(4)])
    pids = list(relay_pids(server).values())
    socket_dir = os.path.dirname(upstream(server).removeprefix("unix:"))
    assert server.stop(signal.SIGTERM) == 0
    time.sleep(0.2)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}")
    assert not named_relay_objects()
    assert not os.path.exists(socket_dir)
    assert "Traceback" not in server.log_text()


def test_a_caller_cannot_have_the_server_write_into_another_callers_relay_region(start_encoder_server):
    """The attack seen on earlier releases: a local user lists /dev/shm and names the relays'
    regions it finds in its own calls, while a victim's responses stream through the relays."""
    server = start_encoder_server("--grpc-processes", "2", "--max-batch-tokens", "4096", "--shared-memory", "off")
    victim, attacker = png(40, (224, 168)), png(41, (224, 168))
    with EncoderClient(server.target, timeout_s=30, shared_memory=False) as client:
        want = client.encode([victim])[0].embedding
    stop = threading.Event()
    attacks: Counter[str] = Counter()

    def attack() -> None:
        with grpc.insecure_channel(server.target) as channel:
            encode = channel.unary_stream(ENCODE, request_serializer=None, response_deserializer=None)
            while not stop.is_set():
                for name in sorted(named_relay_objects()) or ["encoder-relay-0123456789abcdef-1-x"]:
                    request = encoder_pb2.EncodeRequest(
                        images=[encoder_pb2.Image(encoded=attacker)],
                        output_region=encoder_pb2.SharedMemoryRegion(name=name, size=1 << 20))
                    try:
                        list(encode(request.SerializeToString(), timeout=10))
                        attacks["OK"] += 1
                    except grpc.RpcError as err:
                        attacks[err.code().name] += 1
                        assert "encoder-relay" not in (err.details() or ""), err.details()

    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    wrong = calls = 0
    try:
        with EncoderClient(server.target, timeout_s=30, shared_memory=False) as client:  # streamed via relays
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:
                got = client.encode([victim])[0].embedding
                calls += 1
                wrong += not np.array_equal(got, want)
    finally:
        stop.set()
        thread.join(30)
    assert calls >= 10 and sum(attacks.values()) >= 10, (calls, attacks)
    assert wrong == 0, f"{wrong} of {calls} victim calls got another embedding; attacker: {attacks}"
    assert set(attacks) == {"FAILED_PRECONDITION"}, attacks  # the server writes no caller's region


def test_per_client_limits_hold_a_relayed_call_until_its_caller_has_read_it(start_encoder_server):
    """Behind relays the server is done with a call once it has written the relay's region; the
    caller's slot must last until the relay has streamed it all, or callers that stop reading
    hold any number of calls (and regions)."""
    server = start_encoder_server("--grpc-processes", "1", "--max-requests-per-client", "1",
                                  "--max-batch-tokens", "4096")
    with EncoderClient(server.target, timeout_s=30) as client:
        cached = client.encode([png(50, (896, 672))])[0]  # 768 tokens: 147 KB an image in float32
    # 256 references to it: 38 MB, more than the flow-control windows and socket buffers hold
    big = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(content_hash=cached.content_hash)] * 256)
    small = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(content_hash=cached.content_hash)])
    with grpc.insecure_channel(server.target) as channel:
        encode = channel.unary_stream(ENCODE, request_serializer=None, response_deserializer=None)
        stalled = encode(big.SerializeToString(), timeout=60)
        next(stalled)  # the call is under way; then the caller stops reading
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as info:
            list(encode(small.SerializeToString(), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        assert "--max-requests-per-client 1" in info.value.details()
        stalled.cancel()  # the caller goes away: its slot is given back

        def served() -> bool:
            try:
                return len(list(encode(small.SerializeToString(), timeout=30))) == 1
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return False

        assert wait_until(served, 20), server.log_text()
