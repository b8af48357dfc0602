"""--grpc-processes: relay processes own the public port and pass every call on to the server
process. A real server with real relay processes; callers see what the server answers, byte for
byte, and the relays live and die with it. (The server tests of test_server_encode,
test_server_errors, test_shared_memory and test_epd_sink also run behind two relays; TLS through a
relay is in test_security_tls.)"""

from __future__ import annotations

import os
import re
import signal
import time

import client_servers
import grpc
import pytest
from encoder_client import EncoderClient
from encoder_client.protocol import encoder_pb2
from encoder_client.protocol.chunks import parse_chunk
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from bench.reliability.server import wait_until
from encoder_service.api.limits import PerClientLimitInterceptor
from encoder_service.api.relay import upstream_metadata

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
    # The relay read them out of its own shared memory: its regions exist while it runs.
    pids = set(relay_pids(relayed).values())
    names = relay_regions()
    assert any(int(n.split("-")[3]) in pids for n in names), names


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


def relay_regions() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("encoder-relay-")}


def test_a_refused_request_leaves_the_relays_region_to_the_next_call(relayed):
    good = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=png(7))]).SerializeToString()
    bad = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=b"not an image")]).SerializeToString()
    with grpc.insecure_channel(relayed.target) as channel:  # one connection: one relay
        encode = channel.unary_stream(ENCODE, request_serializer=None, response_deserializer=None)
        list(encode(good, timeout=30))
        before = relay_regions()
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                list(encode(bad, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        list(encode(good, timeout=30))
    # The server answered those calls, so it was done with the region: reused, not replaced.
    assert relay_regions() == before


def test_the_relays_do_not_load_torch(relayed):
    for pid in relay_pids(relayed).values():
        with open(f"/proc/{pid}/maps") as f:
            assert "libtorch" not in f.read()


def test_per_client_limits_count_the_callers_address_not_the_relay():
    interceptor = PerClientLimitInterceptor(1, by_token=False, relayed=True)

    class Details:
        invocation_metadata = upstream_metadata((("x-encoder-relayed-peer", "forged"), ("k", "v")),
                                                "ipv4:10.1.2.3:5555")

    class Context:
        @staticmethod
        def peer() -> str:
            return "unix:/tmp/encoder-service-x/server.sock"

    assert dict(Details.invocation_metadata)["k"] == "v"
    assert interceptor._client(Details, Context) == "client 10.1.2.3"  # what the caller forged is gone


def test_a_killed_relay_is_started_again_and_the_port_serves_throughout(start_encoder_server):
    server = start_encoder_server("--grpc-processes", "2")
    before = relay_pids(server)
    os.kill(before[0], signal.SIGKILL)
    assert wait_until(lambda: relay_pids(server).get(0) not in (None, before[0]), 30) is not None, server.log_text()
    assert f"relay 0 (pid {before[0]}) exited" in server.log_text()
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
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith("encoder-relay-") and f"-{pid}-" in n]
    assert not os.path.exists(socket_dir)
    assert "Traceback" not in server.log_text()
