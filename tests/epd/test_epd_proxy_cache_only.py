"""Encode's ``cache_only`` (encode and cache, return the headers only) on a real encoder process, the
EPD proxy using it, and the proxy's answer for image parts that name their image by uuid alone.

The proxy only needs each image cached on the encoder (vLLM's connector fetches the embedding by
its content hash): with ``cache_only`` the encoder answers each image with its header chunk and no
rows, instead of the whole embedding that the proxy dropped (8.8 MB for a 7B model's 1008x1008
image). A part with a uuid and no image is looked up on the encoder before vLLM is called: a uuid
the encoder does not cache is a 400 naming the part (through vLLM it is an HTTP 500 whose reason is
only in vLLM's log).
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
from client_servers import png
from encoder_client import EncoderClient, HashRef
from encoder_client.errors import EncoderClientError
from encoder_client.integrations.proxy import EpdProxy, ProxySettings
from encoder_client.protocol import encoder_pb2
from fake_vllm import Served, chat, data_url, dead_port, forwarded_images, post


@pytest.fixture
def started():
    """Start proxies; each one's EpdProxy and port. Every chunk its encoder calls receive is recorded."""
    served: list[Served] = []

    def start(encoder: list[str], vllm_url: str, **overrides):
        proxy = EpdProxy(ProxySettings(encoder=encoder, vllm=vllm_url, **overrides))
        proxy.chunks = []
        clients = [proxy.bridge.client] if proxy.bridge.single else []
        for client in clients:
            call = client._call_encode

            def recording(request, timeout_s, consume, call=call):
                return call(request, timeout_s, lambda chunks: consume(_recorded(chunks, proxy.chunks)))
            client._call_encode = recording
        served.append(Served(proxy.app()))
        return proxy, served[-1].port

    yield start
    for s in served:
        s.close()


def _recorded(chunks, into: list):
    for chunk in chunks:
        into.append(chunk)
        yield chunk


def test_cache_only_answers_each_image_with_its_header_and_caches_its_embedding(encoder_server):
    from encoder_client.cache_only import encode_cache_only

    images = [png(801), png(802, size=(56, 84))]
    with EncoderClient(encoder_server.target, timeout_s=60) as client:
        request = encoder_pb2.EncodeRequest(request_id="c", images=[encoder_pb2.Image(encoded=i) for i in images],
                                            cache_only=True)
        chunks = client._call_encode(request, None, list)
        assert len(chunks) == 2 and all(c.last and not len(c.data) and c.num_tokens > 0 for c in chunks)
        assert all(c.token_offset == 0 and not c.region_bytes and not c.cache_hit for c in chunks)
        headers = encode_cache_only(client, images)  # again: both hits now, sent as content-hash references
        assert [h.cache_hit for h in headers] == [True, True]
        by_index = {c.image_index: c for c in chunks}
        assert [h.content_hash for h in headers] == [by_index[0].content_hash, by_index[1].content_hash]
        assert client.lookup([h.content_hash for h in headers]) == [True, True]
        # The embedding cached is the image's: fetched by reference it equals a plain encode's.
        (by_ref,) = client.encode([HashRef(headers[0].content_hash)])
        (plain,) = client.encode([images[0]])
        np.testing.assert_array_equal(by_ref.embedding, plain.embedding)
        assert by_ref.num_tokens == headers[0].num_tokens


def test_cache_only_takes_neither_a_sink_nor_an_output_region(encoder_server):
    with EncoderClient(encoder_server.target, timeout_s=60) as client:
        request = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=png(803))], cache_only=True,
                                            sink=encoder_pb2.Sink(target="127.0.0.1:1"))
        with pytest.raises(EncoderClientError) as err:
            client._call_encode(request, None, list)
        assert err.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)


@pytest.mark.parametrize("mode", ["cache", "full"])
def test_the_proxy_moves_no_rows_in_cache_mode(encoder_server, vllm, started, mode):
    proxy, port = started([encoder_server.target], vllm.url, encode_mode=mode)
    image = png(810 if mode == "cache" else 811)
    status, answer, _ = post(port, chat(data_url(image)))
    assert status == 200, answer
    (part,) = forwarded_images(vllm.received[-1])
    with EncoderClient(encoder_server.target) as client:
        assert client.lookup([part["uuid"]]) == [True]
    rows = sum(len(c.data) + c.region_bytes for c in proxy.chunks)  # on the stream or in shared memory
    assert proxy.chunks and (rows == 0 if mode == "cache" else rows > 0)


def test_the_proxy_in_cache_mode_routes_over_several_encoders(encoder_server, vllm, started):
    _, port = started([encoder_server.target, f"127.0.0.1:{dead_port()}"], vllm.url)
    image = png(812)
    assert post(port, chat(data_url(image)))[0] == 200
    (part,) = forwarded_images(vllm.received[-1])
    with EncoderClient(encoder_server.target) as client:
        assert client.lookup([part["uuid"]]) == [True]


def _by_uuid(uuid: str) -> dict:
    return {"model": "qwen", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": None, "uuid": uuid}, {"type": "text", "text": "and this?"}]}]}


def test_a_uuid_the_encoder_does_not_cache_is_a_400_naming_the_part_before_vllm(encoder_server, vllm, started):
    _, port = started([encoder_server.target], vllm.url)
    before = len(vllm.received)
    status, answer, _ = post(port, _by_uuid("ab" * 32))
    error = json.loads(answer)["error"]
    assert status == 400, answer
    assert "messages[0].content[0]: the encoder does not cache the image of uuid " + "ab" * 32 in error["message"]
    assert "send the image itself" in error["message"] and error["param"] == "messages[0].content[0]"
    status, answer, _ = post(port, _by_uuid("not-a-hash"))
    assert status == 400 and "content hash" in json.loads(answer)["error"]["message"]
    assert len(vllm.received) == before


def test_a_uuid_the_encoder_caches_goes_to_vllm_as_it_was_sent(encoder_server, vllm, started):
    _, port = started([encoder_server.target], vllm.url)
    with EncoderClient(encoder_server.target, timeout_s=60) as client:
        (result,) = client.encode([png(813)])
    status, answer, _ = post(port, _by_uuid(result.content_hash))
    assert status == 200, answer
    (part,) = forwarded_images(vllm.received[-1])
    assert part == {"type": "image_url", "image_url": None, "uuid": result.content_hash}


def test_a_real_encoders_full_queue_is_a_503_with_retry_after_and_an_image_over_its_limits_a_413(
        start_encoder_server, vllm, started):
    """RESOURCE_EXHAUSTED by its cause, from a real server: its retry-pushback trailer says a full
    queue (1000 ms: 503 with Retry-After) from a request over a limit by itself (-1: 413)."""
    from encoder_client.protocol import encoder_pb2_grpc
    from server_queue import one_running_one_queued

    server = start_encoder_server("--max-queue-images", "1", "--max-image-pixels", "4000000")
    _, port = started([server.target], vllm.url)
    before = len(vllm.received)
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = encoder_pb2_grpc.VisionEncoderStub(channel)
        big = one_running_one_queued(server, stub, (30, 31))  # the one queue slot taken
        status, answer, headers = post(port, chat(data_url(png(820))))
        assert status == 503, answer
        assert "queue full" in json.loads(answer)["error"]["message"] and headers["Retry-After"] == "1"
        for thread, _ in big:
            thread.join(120)
    status, answer, headers = post(port, chat(data_url(png(821, size=(2100, 2100), solid=True))))
    assert status == 413, answer
    assert "over its limits" in json.loads(answer)["error"]["message"] and "Retry-After" not in headers
    assert len(vllm.received) == before
    server.stop()


def test_cache_only_through_relay_processes_answers_headers_only(start_encoder_server):
    server = start_encoder_server("--grpc-processes", "2")
    images = [png(830), png(831)]
    with EncoderClient(server.target, timeout_s=60, shared_memory=False) as client:
        request = encoder_pb2.EncodeRequest(images=[encoder_pb2.Image(encoded=i) for i in images], cache_only=True)
        chunks = client._call_encode(request, None, list)
        assert len(chunks) == 2 and all(c.last and not len(c.data) and not c.region_bytes for c in chunks)
        assert client.lookup([c.content_hash for c in chunks]) == [True, True]
    server.stop()
