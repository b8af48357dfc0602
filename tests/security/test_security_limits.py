"""--max-requests-per-client: concurrent Encode calls per client, refused beyond the limit with
RESOURCE_EXHAUSTED, released however a call ends. A real server (clients told apart by their
tokens) and, for every way a call can end, the interceptor on an in-process grpc.aio server."""

from __future__ import annotations

import asyncio
import time

import client_servers
import grpc
import pytest
from encoder_client import EncoderClient
from encoder_client._request import build_request
from encoder_client.protocol import encoder_pb2, encoder_pb2_grpc

from encoder_service.api.security.client_limits import PerClientLimitInterceptor, peer_address
from encoder_service.api.service_interceptor import CallBook, ServiceInterceptor
from encoder_service.metrics import ServiceMetrics

ENCODE = "/encoder.v1.VisionEncoder/Encode"


def png(seed: int) -> bytes:
    return client_servers.png(seed, (56, 56), solid=True)


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


@pytest.fixture(scope="module")
def server(start_encoder_server, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text("client-a\nclient-b\n")
    # A forward waits up to 4 s for more images: an Encode stays open that long, long enough to
    # hold two and be refused a third, deterministically.
    return start_encoder_server("--auth-token-file", str(tokens), "--max-requests-per-client", "2",
                                "--batch-wait-ms", "4000")


def wait_in_flight(server, n: int) -> None:
    deadline = time.monotonic() + 5
    while server.metric("encoder_service_requests_in_flight") < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests in flight"
        time.sleep(0.02)


def test_a_client_over_its_limit_is_refused_while_others_are_served(server):
    with grpc.insecure_channel(server.target) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)  # the deadline below is not the connect's
        stub = encoder_pb2_grpc.VisionEncoderStub(channel)

        def request(seed: int) -> encoder_pb2.EncodeRequest:
            return build_request([png(seed)], output_dtype=None, max_chunk_bytes=None, request_id=None)

        held = stub.Encode(request(1), metadata=bearer("client-a"))  # ends OK, with the forward
        # Ends by its deadline, which must outlast the refusal below (metrics polled over HTTP on a
        # loaded CI machine) and come before the forward (the batch waits 4 s): 2.5 s leaves room both ways.
        expiring = stub.Encode(request(2), metadata=bearer("client-a"), timeout=2.5)
        wait_in_flight(server, 2)

        with pytest.raises(grpc.RpcError) as info:
            list(stub.Encode(request(3), metadata=bearer("client-a")))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-requests-per-client 2" in info.value.details()
        assert dict(info.value.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"  # may pass later

        with EncoderClient(server.target, token="client-b", timeout_s=30, retries=0) as other:
            assert other.encode([png(4)])[0].num_tokens == 4  # another client: served meanwhile

        assert len(list(held)) == 1
        with pytest.raises(grpc.RpcError) as info:
            list(expiring)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    with EncoderClient(server.target, token="client-a", timeout_s=10, retries=0) as again:
        assert again.encode([png(5)])[0].num_tokens == 4  # both ended: client-a is served again
        # Lookup and GetModelInfo are not limited.
        assert again.model_info().hidden_size == 48


@pytest.mark.parametrize("peer, address", [
    ("ipv4:10.1.2.3:51234", "10.1.2.3"),
    ("ipv6:[::1]:51234", "::1"),
    ("ipv6:%5B2001:db8::7%5D:443", "2001:db8::7"),
    ("ipv6:[::ffff:10.0.0.9]:51234", "10.0.0.9"),
    ("unix:/run/encoder.sock", "unix:/run/encoder.sock"),
])
def test_a_client_without_a_token_is_its_peers_ip_address(peer, address):
    assert peer_address(peer) == address


# --- every way a call ends gives its slot back (in-process server, a handler the test controls) ---


async def _limited_server(interceptor: PerClientLimitInterceptor, gate: asyncio.Event, style: str):
    async def encode(request: bytes, context: grpc.aio.ServicerContext) -> None:
        await gate.wait()
        if request == b"fail":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad image")
        await context.write(b"chunk")

    async def encode_generator(request: bytes, context: grpc.aio.ServicerContext):
        await gate.wait()
        if request == b"fail":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad image")
        yield b"chunk"

    # As in the server: the service interceptor first, answering the limit's refusal.
    server = grpc.aio.server(interceptors=[ServiceInterceptor(ServiceMetrics(), CallBook()), interceptor])
    behaviour = encode if style == "coroutine" else encode_generator
    handlers = {"Encode": grpc.unary_stream_rpc_method_handler(behaviour)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("encoder.v1.VisionEncoder", handlers),))
    server.add_registered_method_handlers("encoder.v1.VisionEncoder", handlers)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _finish(call) -> grpc.StatusCode:
    """Reads the call to its end (a status arrives after the messages are read) and returns its code."""
    if not call.cancelled():
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError:
            pass
    return await call.code()


@pytest.mark.parametrize("style", ["coroutine", "async-generator"])
@pytest.mark.parametrize("ending", ["ok", "error", "cancel", "deadline"])
def test_the_slot_is_released_however_the_call_ends(ending, style):
    async def run() -> None:
        interceptor = PerClientLimitInterceptor(2, by_token=False)
        gate = asyncio.Event()
        server, target = await _limited_server(interceptor, gate, style)
        client = "client 127.0.0.1"
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                await asyncio.wait_for(channel.channel_ready(), 10)  # the deadline below is not the connect's
                encode = channel.unary_stream(ENCODE)
                payload = b"fail" if ending == "error" else b"ok"
                # The held calls must outlast the refusal below on a loaded machine, then expire.
                timeout = 2.0 if ending == "deadline" else 10
                calls = [encode(payload, timeout=timeout) for _ in range(2)]
                async with asyncio.timeout(5):
                    while interceptor.limits.in_flight(client) < 2:
                        await asyncio.sleep(0.01)
                refused = encode(b"ok", timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await refused.read()
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

                if ending == "cancel":
                    for call in calls:
                        call.cancel()
                elif ending in ("ok", "error"):
                    gate.set()
                codes = {await _finish(call) for call in calls}
                expected = {"ok": grpc.StatusCode.OK, "error": grpc.StatusCode.INVALID_ARGUMENT,
                            "cancel": grpc.StatusCode.CANCELLED, "deadline": grpc.StatusCode.DEADLINE_EXCEEDED}
                assert codes == {expected[ending]}
                for _ in range(200):  # the server sees a cancel or a deadline a moment after the client
                    if interceptor.limits.in_flight(client) == 0:
                        break
                    await asyncio.sleep(0.01)
                assert interceptor.limits.in_flight(client) == 0
                gate.set()
                assert [m async for m in encode(b"ok", timeout=10)] == [b"chunk"]  # served again
        finally:
            await server.stop(0)

    asyncio.run(run())
