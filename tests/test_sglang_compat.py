"""The SGLang-compatible front end (--sglang-compat-port) against SGLang 0.5.23's own code.

A real server process (tiny preset) is called with SGLang's own gRPC client functions, the way its
language server calls an encoder (``MMReceiverGrpc.encode`` splitting a request into parts,
``_grpc_encode_request``, ``_grpc_scheduler_receive_url``), and its pushes are received over real
ZMQ sockets with SGLang's own receiver code (``safe_pickle_loads``, the part checks and aggregation,
the ``torch.frombuffer`` path): tests/sglang_code.py says why those are loaded from the wheel's
source rather than imported whole. The embeddings must equal the bytes our own service returns.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.server
import io
import re
import shlex
import threading
import types

import grpc
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio
from encoder_client import EncoderClient
from PIL import Image

SIZES = ((56, 56), (84, 56), (56, 112))


@pytest.fixture(scope="module")
def sg():
    try:
        import sglang_code
        return sglang_code.load()
    except ImportError as exc:  # under CI this skip is a failure (tests/conftest.py)
        pytest.skip(f"SGLang's wheel is not installed (bash scripts/ci_tools.sh installs it): {exc}")


@pytest.fixture(scope="module")
def server(start_encoder_server, sg):
    s = start_encoder_server("--sglang-compat-port", "0", "--allowed-sinks", "127.0.0.1:*",
                             "--allow-url-fetch", "127.0.0.2,localhost")
    port = re.search(r"SGLang-compatible encoder .* on 127\.0\.0\.1:(\d+)", s.log_text()).group(1)
    s.sglang_url = f"grpc://127.0.0.1:{port}"
    return s


def _png(size, seed):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def images():
    return [_png(size, seed) for seed, size in enumerate(SIZES)]


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _reference(server, pngs) -> tuple[torch.Tensor, list]:
    """Our own service's embeddings of pngs, concatenated, and their grids."""
    with EncoderClient(server.target) as client:
        results = sorted(client.encode(pngs), key=lambda r: r.index)
    return torch.from_numpy(np.concatenate([r.embedding for r in results])), [list(r.grid_thw) for r in results]


def _pull(ctx: zmq.asyncio.Context) -> tuple[zmq.asyncio.Socket, int]:
    sock = ctx.socket(zmq.PULL)
    return sock, sock.bind_to_random_port("tcp://127.0.0.1")


async def _receive_tokenizer(sg, sock, req_id: str):
    """SGLang's zmq_to_tokenizer receive (MMReceiverBase._recv_mm_data), up to its processor call."""
    r = sg.receiver
    data = None
    while data is None or not data.ready:
        parts = await sock.recv_multipart(copy=False)
        recv_obj = sg.common.safe_pickle_loads(parts[0])
        assert r._embedding_part_matches_request(recv_obj, req_id)
        assert recv_obj.error_msg is None and len(parts) == 2
        r.extract_embedding_from_buffer(None, recv_obj, parts)  # the torch.frombuffer path
        data = r._aggregate_embedding_part(data, recv_obj, None)
    return data


async def _receive_scheduler(sg, sock):
    """One scheduler rank's receive (MMReceiverBase._drain_scheduler_embeddings, consume_parts)."""
    r = sg.receiver
    data = None
    while data is None or not data.ready:
        parts = await sock.recv_multipart(copy=False)
        recv_obj = sg.common.safe_pickle_loads(parts[0])
        assert r._resolve_embedding_part_request_id(recv_obj) is not None
        r.extract_embedding_from_buffer(None, recv_obj, parts)
        data = r._aggregate_embedding_part(data, recv_obj, None)
    return data


def _language_side(sg, urls):
    """What MMReceiverGrpc.encode reads of its receiver: the encoder URLs and its own host."""
    return types.SimpleNamespace(encode_urls=urls, host="127.0.0.1")


def _image_items(sg, pngs):
    return [{"url": _data_url(p), "modality": sg.Modality.IMAGE} for p in pngs]


def test_multi_part_request_reassembles_to_our_embeddings(sg, server, images):
    """zmq_to_tokenizer: SGLang splits 3 images over two 'encoders' (both this server): 2 parts."""
    expected, grids = _reference(server, images)

    async def run():
        ctx = zmq.asyncio.Context()
        sock, port = _pull(ctx)
        try:
            receive = asyncio.ensure_future(_receive_tokenizer(sg, sock, "req-multi"))
            await sg.receiver.grpc_receiver_encode(
                _language_side(sg, [server.sglang_url] * 2), "req-multi", _image_items(sg, images), port, "encode",
                num_items_assigned=[2, 1])
            return await asyncio.wait_for(receive, 60)
        finally:
            sock.close(linger=0)
            ctx.term()

    data = asyncio.run(run())
    assert data.num_parts == 2 and [e.shape[0] for e in data.embedding_list] == [
        sum(int(np.prod(g)) // 4 for g in grids[:2]), int(np.prod(grids[2])) // 4]
    got = data.get_embedding(is_concat=True)[sg.Modality.IMAGE]
    assert got.dtype == expected.dtype and torch.equal(got, expected)  # the same bytes as encoder_client's
    assert data.get_mm_extra_meta()["img_grid_thw"].tolist() == grids


def test_scheduler_ranks_registered_by_receive_url_each_get_the_embedding(sg, server, images):
    """zmq_to_scheduler: no port in Encode; two TP ranks register (receive_count=2) after it began."""
    expected, _ = _reference(server, images[:2])
    target = sg.receiver._grpc_target(server.sglang_url)

    async def run():
        ctx = zmq.asyncio.Context()
        socks = [_pull(ctx) for _ in range(2)]
        try:
            receives = [asyncio.ensure_future(_receive_scheduler(sg, s)) for s, _ in socks]
            encode = asyncio.ensure_future(sg.receiver.grpc_receiver_encode(
                _language_side(sg, [server.sglang_url]), "req-sched", _image_items(sg, images[:2]), None, "encode",
                num_items_assigned=[2]))
            await asyncio.sleep(0.2)
            for _, port in socks:
                await sg.receiver._grpc_scheduler_receive_url(target, "req-sched", f"127.0.0.1:{port}", 2)
            await asyncio.wait_for(encode, 60)
            return await asyncio.wait_for(asyncio.gather(*receives), 60)
        finally:
            for s, _ in socks:
                s.close(linger=0)
            ctx.term()

    for data in asyncio.run(run()):
        assert data.req_id == "req-sched" and torch.equal(data.get_embedding(is_concat=True)[sg.Modality.IMAGE],
                                                          expected)


def _encode(sg, server, items, port, req_id="req-x", num_parts=1, part_idx=0, host="127.0.0.1"):
    """SGLang's _grpc_encode_request: raises grpc.RpcError on an error status."""
    return sg.receiver._grpc_encode_request(sg.receiver._grpc_target(server.sglang_url), {
        "mm_items": items, "req_id": req_id, "num_parts": num_parts, "part_idx": part_idx, "prefill_host": host,
        "embedding_port": port})


def _receive_one(sg, server, items, **kw):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        response = _encode(sg, server, items, port, **kw)
        assert sock.poll(30_000)
        parts = sock.recv_multipart(copy=False)
        recv_obj = sg.common.safe_pickle_loads(parts[0])
        sg.receiver.extract_embedding_from_buffer(None, recv_obj, parts)
        return response, recv_obj
    finally:
        sock.close(linger=0)
        ctx.term()


def test_content_digests_match_sglangs_mm_content_hashes(sg, server, images):
    from smg_grpc_proto import sglang_encoder_pb2, sglang_encoder_pb2_grpc

    response, recv_obj = _receive_one(sg, server, [_data_url(images[0])])
    digest = "sha256:" + hashlib.sha256(images[0]).hexdigest()
    assert sg.identity._digest_bytes(images[0]) == digest  # how SGLang computes mm_content_hashes
    assert recv_obj.mm_content_hashes == [digest]
    with EncoderClient(server.target) as client:
        ours = next(iter(client.encode([images[0]]))).content_hash
    assert recv_obj.encoder_content_hashes == [ours]
    assert response.embedding_len == recv_obj.shape[0] and response.embedding_dim == recv_obj.shape[1]
    with grpc.insecure_channel(sg.receiver._grpc_target(server.sglang_url)) as channel:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        _, call = sglang_encoder_pb2_grpc.SglangEncoderStub(channel).Encode.with_call(sglang_encoder_pb2.EncodeRequest(
            mm_items=[_data_url(images[0])], req_id="req-md", num_parts=1, part_idx=0, prefill_host="127.0.0.1",
            embedding_port=[port]), timeout=60)
        sock.close(linger=0)
        ctx.term()
    trailers = dict(call.trailing_metadata())
    assert trailers["x-mm-content-hashes"] == digest and trailers["x-encoder-content-hashes"] == ours


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def image_http_server(images):
    _ImageHandler.body = images[1]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.2", 0), _ImageHandler)  # all of 127/8 is loopback
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_http_url_of_an_explicitly_listed_address_is_fetched(sg, server, images, image_http_server):
    expected, _ = _reference(server, [images[1]])
    _, recv_obj = _receive_one(sg, server, [f"http://127.0.0.2:{image_http_server}/cat.png"])
    assert torch.equal(recv_obj.embedding, expected)


BAD_INPUTS = {
    "not base64": (["data:image/png;base64,@@@not-base64@@@"], "INVALID_ARGUMENT", "mm_items[0]: the data URL's"),
    "not an image": ([_data_url(b"this is not an image")], "INVALID_ARGUMENT", "image 0"),
    "a local path": (["/etc/passwd"], "INVALID_ARGUMENT", "never reads local files"),
    "a host not listed": (["http://example.com/cat.png"], "PERMISSION_DENIED", "not in --allow-url-fetch"),
    # localhost is listed by name, but its loopback address is not listed as an IP (127.0.0.2 is)
    "a name resolving to loopback": (["http://localhost:9/cat.png"], "PERMISSION_DENIED", "resolves to 127.0.0.1"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_get_a_clear_error_and_the_server_serves_on(sg, server, images, case):
    items, code, message = BAD_INPUTS[case]
    with pytest.raises(grpc.RpcError) as err:
        _encode(sg, server, [_data_url(images[0]), *items], [1], req_id=f"bad-{case}")
    assert err.value.code().name == code
    assert message.replace("[0]", "[1]").replace("image 0", "image 1") in err.value.details()
    _, recv_obj = _receive_one(sg, server, [_data_url(images[0])])  # and the next request is served
    assert recv_obj.shape[0] > 0


@pytest.mark.parametrize(("kw", "code", "message"), [
    ({"num_parts": 2, "part_idx": 2}, "INVALID_ARGUMENT", "part_idx must be in [0, 2)"),
    ({"req_id": ""}, "INVALID_ARGUMENT", "req_id must be"),
    ({"host": "10.9.9.9"}, "PERMISSION_DENIED", "not in this encoder's --allowed-sinks"),
])
def test_bad_requests_and_receivers_are_refused_before_any_work(sg, server, images, kw, code, message):
    with pytest.raises(grpc.RpcError) as err:
        _encode(sg, server, [_data_url(images[0])], [1], **kw)
    assert err.value.code().name == code and message in err.value.details()


def test_send_is_unimplemented_and_receive_url_is_checked(sg, server):
    from smg_grpc_proto import sglang_encoder_pb2, sglang_encoder_pb2_grpc

    with grpc.insecure_channel(sg.receiver._grpc_target(server.sglang_url)) as channel:
        stub = sglang_encoder_pb2_grpc.SglangEncoderStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Send(sglang_encoder_pb2.SendRequest(req_id="r", prefill_host="127.0.0.1", embedding_port=1))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "Mooncake" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        asyncio.run(sg.receiver._grpc_scheduler_receive_url(
            sg.receiver._grpc_target(server.sglang_url), "r", "10.1.2.3:5000", 1))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "10.1.2.3:5000" in err.value.details()


def test_the_readme_encoder_command_parses():
    from conftest import REPO_ROOT

    from encoder_service.config import parse_serve_args

    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Using it with SGLang", 1)[1].split("\n## ", 1)[0]
    commands = [c for c in re.findall(r"```bash\n(.*?)```", section, re.S)[0].replace("\\\n", " ").splitlines()
                if c.strip().startswith("encoder-service serve")]
    assert len(commands) == 1
    argv = shlex.split(commands[0].split("#")[0])
    config = parse_serve_args(argv[2:], environ={})
    assert config.sglang_compat_port > 0 and config.allowed_sink_patterns


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_header_is_what_sglangs_encoder_pickles(sg, dtype):
    """Our hand-written pickle loads (through SGLang's allowlist) to the same object as SGLang's own
    ``pickle.dumps(EmbeddingData(...).copy_without_embedding())``, attribute for attribute."""
    import pickle

    from encoder_service.api.sglang_header import embedding_data_header

    ours = sg.common.safe_pickle_loads(embedding_data_header(
        "rid", 3, 2, [(1, 4, 6), (2, 8, 8)], 38, 48, dtype, mm_content_hashes=["sha256:00"]))
    embedding = torch.zeros(38, 48, dtype=getattr(torch, dtype))
    real = sg.receiver.EmbeddingData("rid", 3, 2, [[1, 4, 6], [2, 8, 8]], sg.Modality.IMAGE, embedding,
                                     mm_content_hashes=["sha256:00"])
    theirs = sg.common.safe_pickle_loads(pickle.dumps(real.copy_without_embedding()))
    assert type(ours) is type(theirs) and list(vars(ours).items()) == list(vars(theirs).items())
