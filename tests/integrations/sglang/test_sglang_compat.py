"""The SGLang-compatible front end (--sglang-compat-port) against SGLang 0.5.23's own code.

A real server process (tiny preset) is called with SGLang's own gRPC client functions, the way its
language server calls an encoder (``MMReceiverGrpc.encode`` splitting a request into parts,
``_grpc_encode_request``, ``_grpc_scheduler_receive_url``), and its pushes are received over real
ZMQ sockets by SGLang's own receive loops (the tokenizer's ``_recv_mm_data``; a scheduler rank's
``WaitingZmqRequestGrpc``, which also registers the rank, and ``_drain_scheduler_embeddings``):
tests/sglang_code.py says why those are loaded from the wheel's source rather than imported whole.
The embeddings must equal the bytes our own service returns.

The port's bounds are tested against real servers too: a flood of registrations from one host
leaves room for another's, embeddings awaiting delivery are bounded in bytes and time, a URL whose
server drips one byte a second is cut at the fetch bound, and tokens and per-client limits hold on
this port as on the main one (SGLang's own client, which sends no token, included).
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
import time
import types
from collections import Counter

import grpc
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio
from encoder_client import EncoderClient, EncoderClientError
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


class _Processor:
    """The language server's multimodal processor, where SGLang's receive ends: its
    ``get_validated_mm_data(prompt, embedding, **extra_meta)`` gets the reassembled embeddings and
    their metadata (``img_grid_thw``). A model's processor builds its inputs from them; this one
    keeps them for the test."""

    prefer_tokenized_input = False

    def get_validated_mm_data(self, prompt, embedding, **meta):
        return types.SimpleNamespace(prompt=prompt, embedding=embedding, meta=meta, input_ids=[0], mm_items=[])


async def _receive_tokenizer(sg, sock, req_id: str):
    """zmq_to_tokenizer: SGLang's own receive loop, ``MMReceiverBase._recv_mm_data`` (it reads only
    ``model_type`` of its receiver, None for a model without per-model video metadata)."""
    received = await sg.receiver.recv_mm_data_loop(types.SimpleNamespace(model_type=None), req_id, sock,
                                                   _Processor(), "prompt")
    assert received is not None, "SGLang's receive loop gave up (it logs why and returns None)"
    return received


class _SchedulerRank:
    """One scheduler TP rank in zmq_to_scheduler mode, with SGLang's own objects: the shared PULL
    socket ``MMReceiverBase.__init__`` binds (``get_zmq_socket_on_host``) and its
    ``_ReceiveRegistrationRunner``; per request a ``WaitingZmqRequestGrpc``, whose
    ``send_encode_request`` registers the rank with every encoder of the request
    (``SchedulerReceiveUrl``) and whose ``consume_parts``/``_try_recv_mm_data`` receive and assemble.

    ``tick`` is what ``MMReceiverBase._process_waiting_requests`` does for a rank on each scheduler
    iteration: ``_drain_scheduler_embeddings`` (SGLang's), then ``_try_recv_mm_data`` of every waiting
    request. ``_process_waiting_requests`` itself cannot run here: it tells new requests apart with
    ``isinstance`` against ``TokenizedGenerateReqInput`` and ``EncoderDispatchErrorReq`` of
    ``sglang.srt.managers.io_struct``, which imports the ``sglang.srt.utils`` package (its
    ``__init__`` needs orjson and triton, which the ``--no-deps`` install leaves out); it all-reduces
    the requests' status over the TP group (``torch.distributed`` on ``tp_group.cpu_group``: an
    initialised process group of the ranks); and it fails requests through ``create_req``
    (``sglang.srt.managers.schedule_batch.Req``, SGLang's runtime). ``MMReceiverBase.__init__``
    cannot run either (it reads the runtime context: ``get_disagg()``, ``get_parallel()``), so the
    attributes it sets for a rank, and that the code above reads, are set here as it sets them."""

    def __init__(self, sg, name: str) -> None:
        self.sg = sg
        self.scheduler_context = zmq.Context()
        self.scheduler_embedding_port, self.scheduler_recv_socket = sg.get_zmq_socket_on_host(
            self.scheduler_context, zmq.PULL, host="127.0.0.1")
        self.registration_runner = sg.receiver._ReceiveRegistrationRunner(name)
        self.waiting_by_rid: dict = {}

    def start(self, rid: str, encoder_urls: list[str], num_items_assigned: list[int], receive_count: int):
        recv_req = types.SimpleNamespace(rid=rid, num_items_assigned={self.sg.Modality.IMAGE: num_items_assigned},
                                         input_ids=None, input_text="prompt", mm_inputs=None)
        waiting = self.sg.receiver.WaitingZmqRequestGrpc(
            rid=rid, recv_req=recv_req, mm_processor=_Processor(), encoder_urls=encoder_urls, model_type=None,
            host_name="127.0.0.1", receive_count=receive_count, zmq_context=None,
            embedding_port=self.scheduler_embedding_port, registration_runner=self.registration_runner)
        self.waiting_by_rid[rid] = waiting
        waiting.send_encode_request()
        return waiting

    def tick(self) -> None:
        self.sg.receiver.drain_scheduler_embeddings(self)
        for waiting in self.waiting_by_rid.values():
            waiting._try_recv_mm_data()

    def close(self) -> None:
        for waiting in self.waiting_by_rid.values():
            waiting.release_resources()
            waiting.zmq_context.term()
        self.registration_runner.loop.call_soon_threadsafe(self.registration_runner.loop.stop)
        self.scheduler_recv_socket.close(linger=0)
        self.scheduler_context.term()


async def _until_done(sg, ranks, waiting, timeout_s: float = 60.0) -> None:
    """Scheduler iterations until every waiting request has left PENDING."""
    deadline = time.monotonic() + timeout_s
    pending = sg.receiver.WaitingMMRequestStatus.PENDING
    while any(w.status == pending for w in waiting):
        assert time.monotonic() < deadline, "the scheduler ranks received nothing"
        for rank in ranks:
            rank.tick()
        await asyncio.sleep(0.01)


async def _scheduler_request(sg, server, rid: str, pngs, tp_size: int = 2):
    """A whole zmq_to_scheduler request: ``tp_size`` ranks register (SGLang's registration, on its
    runner threads), the tokenizer side sends the Encode with no port (what
    ``MMReceiverBase._run_encode_in_thread`` calls: ``MMReceiverGrpc.encode`` with
    ``embedding_port=None``), the ranks receive. Returns each rank's waiting request."""
    ranks = [_SchedulerRank(sg, f"rank-{i}") for i in range(tp_size)]
    try:
        waiting = [rank.start(rid, [server.sglang_url], [len(pngs)], tp_size) for rank in ranks]
        await sg.receiver.grpc_receiver_encode(_language_side(sg, [server.sglang_url]), rid, _image_items(sg, pngs),
                                               None, "encode", num_items_assigned=[len(pngs)])
        await _until_done(sg, ranks, waiting)
        return waiting
    finally:
        for rank in ranks:
            rank.close()


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

    received = asyncio.run(run())  # ready only once both parts arrived and were reassembled
    got = received.embedding[sg.Modality.IMAGE]
    assert got.dtype == expected.dtype and torch.equal(got, expected)  # the same bytes as encoder_client's
    assert received.meta["img_grid_thw"].tolist() == grids


def test_scheduler_ranks_registered_by_receive_url_each_get_the_embedding(sg, server, images):
    """zmq_to_scheduler: no port in Encode; two TP ranks register (receive_count=2) and receive."""
    expected, grids = _reference(server, images[:2])
    success = sg.receiver.WaitingMMRequestStatus.SUCCESS
    for waiting in asyncio.run(_scheduler_request(sg, server, "req-sched", images[:2])):
        assert waiting.status == success, waiting.error_msg
        mm_inputs = waiting.recv_req.mm_inputs  # what the rank's processor built, as SGLang assembles it
        assert torch.equal(mm_inputs.embedding[sg.Modality.IMAGE], expected)
        assert mm_inputs.meta["img_grid_thw"].tolist() == grids[:2]


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
    from repo_paths import REPO_ROOT

    from encoder_service.config_flags import parse_serve_args

    section = (REPO_ROOT / "docs" / "sglang.md").read_text()
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

    from encoder_service.api.sglang.header import embedding_data_header

    ours = sg.common.safe_pickle_loads(embedding_data_header(
        "rid", 3, 2, [(1, 4, 6), (2, 8, 8)], 38, 48, dtype, mm_content_hashes=["sha256:00"]))
    embedding = torch.zeros(38, 48, dtype=getattr(torch, dtype))
    real = sg.receiver.EmbeddingData("rid", 3, 2, [[1, 4, 6], [2, 8, 8]], sg.Modality.IMAGE, embedding,
                                     mm_content_hashes=["sha256:00"])
    theirs = sg.common.safe_pickle_loads(pickle.dumps(real.copy_without_embedding()))
    assert type(ours) is type(theirs) and list(vars(ours).items()) == list(vars(theirs).items())


# --- the port's bounds: registrations, held embeddings, URL fetches, tokens and per-client limits ---


def _sglang_port(server) -> str:
    return re.search(r"SGLang-compatible encoder .* on 127\.0\.0\.1:(\d+)", server.log_text()).group(1)


def _stub(channel):
    from smg_grpc_proto import sglang_encoder_pb2_grpc

    return sglang_encoder_pb2_grpc.SglangEncoderStub(channel)


def _request(png: bytes, req_id: str, ports=()):
    from smg_grpc_proto import sglang_encoder_pb2

    return sglang_encoder_pb2.EncodeRequest(mm_items=[_data_url(png)], req_id=req_id, num_parts=1, part_idx=0,
                                            prefill_host="127.0.0.1", embedding_port=list(ports))


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def _forward_from(source: str, port: int):
    """A TCP forwarder on 127.0.0.1 whose connections reach 127.0.0.1:port from the address
    ``source`` (all of 127/8 is loopback): the server sees its callers as another host."""

    async def pipe(reader, writer):
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def handle(reader, writer):
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    forwarder = await asyncio.start_server(handle, "127.0.0.1", 0)
    return forwarder, forwarder.sockets[0].getsockname()[1]


def test_junk_registrations_from_one_source_do_not_lock_out_another(sg, server, images):
    """A flood of SchedulerReceiveUrl calls for req_ids no Encode will ever name, from one host
    (more than the server's whole registration table), then a real zmq_to_scheduler request from
    another host: its ranks register and receive."""
    from smg_grpc_proto import sglang_encoder_pb2

    expected, _ = _reference(server, images[:1])
    codes: Counter = Counter()

    async def flood():
        forwarder, port = await _forward_from("127.0.0.5", int(_sglang_port(server)))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = _stub(channel)

                async def junk(i: int) -> None:
                    try:
                        await stub.SchedulerReceiveUrl(sglang_encoder_pb2.SchedulerReceiveUrlRequest(
                            req_id=f"junk-{i}", receive_url="127.0.0.1:9", receive_count=8), timeout=60)
                        codes["OK"] += 1
                    except grpc.aio.AioRpcError as exc:
                        codes[exc.code().name] += 1
                        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()

                for start in range(0, 4200, 100):
                    await asyncio.gather(*(junk(i) for i in range(start, start + 100)))
        finally:
            forwarder.close()

    asyncio.run(flood())
    assert sum(codes.values()) == 4200
    success = sg.receiver.WaitingMMRequestStatus.SUCCESS
    for waiting in asyncio.run(_scheduler_request(sg, server, "after-the-flood", images[:1])):
        assert waiting.status == success, waiting.error_msg
        assert torch.equal(waiting.recv_req.mm_inputs.embedding[sg.Modality.IMAGE], expected)


class _DripHandler(http.server.BaseHTTPRequestHandler):
    """An image URL whose server sends its body one byte a second (or its headers, one byte each
    0.5 s), for minutes; ``ended`` is set when it stops, the client having gone or not."""

    DRIP_S = 120
    ended = threading.Event()

    def do_GET(self):
        try:
            if self.path.startswith("/slow-headers"):
                head = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nX-Padding: " + b"x" * self.DRIP_S + b"\r\n\r\n"
                for i in range(len(head)):  # a byte every 0.5 s: no socket timeout of 1 s is reached
                    self.wfile.write(head[i:i + 1])
                    self.wfile.flush()
                    time.sleep(0.5)
            else:
                self.send_response(200)
                self.send_header("Content-Length", str(1 << 20))
                self.end_headers()
                for _ in range(self.DRIP_S):
                    self.wfile.write(b"\x89")
                    self.wfile.flush()
                    time.sleep(1)
        except OSError:
            pass  # the client closed the connection
        finally:
            type(self).ended.set()

    def log_message(self, *args):
        pass


@pytest.fixture
def drip_server():
    _DripHandler.ended = threading.Event()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.2", 0), _DripHandler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_a_slow_drip_url_is_cut_at_the_fetch_bound(sg, server, images, drip_server):
    """One byte a second keeps every read short of its size and every socket timeout unreached:
    the fetch is cut at its wall-clock bound (10 s) all the same, the connection closed, and the
    server serves on."""
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        _encode(sg, server, [f"http://127.0.0.2:{drip_server}/slow.png"], [1], req_id="drip")
    elapsed = time.monotonic() - started
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert "mm_items[0]" in err.value.details() and "took over 10 s" in err.value.details()
    assert elapsed < 45  # 10 s, with room for a loaded machine (SGLang's own call deadline is 60 s)
    assert _DripHandler.ended.wait(30)  # the server closed the connection: the drip stopped early
    _, recv_obj = _receive_one(sg, server, [_data_url(images[0])])
    assert recv_obj.shape[0] > 0


def test_the_fetch_bound_holds_while_headers_drip_too(drip_server):
    from encoder_service.api.sglang.url_fetch import UrlFetcher
    from encoder_service.errors import Unavailable

    fetcher = UrlFetcher(("127.0.0.2:*",), 1 << 20, timeout_s=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(Unavailable, match=r"took over 1 s"):
            asyncio.run(fetcher.fetch(f"http://127.0.0.2:{drip_server}/slow-headers.png", "mm_items[0]"))
    finally:
        fetcher.close()
    assert time.monotonic() - started < 15
    assert _DripHandler.ended.wait(30)


class _TlsHandler(_DripHandler):
    body = b""

    def do_GET(self):
        if self.path == "/image.png":
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.body)))
            self.end_headers()
            self.wfile.write(self.body)
        else:
            super().do_GET()


def test_https_fetches_check_the_name_and_are_cut_at_the_bound_too(tmp_path, monkeypatch, images):
    """Over TLS (certificate checked against the URL's host), a fetch succeeds, and a drip, during
    the body, is cut at the bound as over plain HTTP."""
    import ssl

    from certs import make_ca

    from encoder_service.api.sglang import url_fetch
    from encoder_service.errors import Unavailable

    ca = make_ca(tmp_path, "fetch")
    pair = ca.issue("server", server=True)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(pair.cert, pair.key)
    _TlsHandler.body, _TlsHandler.ended = images[2], threading.Event()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _TlsHandler)
    httpd.daemon_threads = True
    httpd.socket = server_ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    # The system's roots do not know this CA: the fetcher's TLS context trusts it instead.
    default_context = ssl.create_default_context
    monkeypatch.setattr(url_fetch.ssl, "create_default_context", lambda: default_context(cafile=ca.cert))
    fetcher = url_fetch.UrlFetcher(("127.0.0.1:*",), 1 << 20, timeout_s=2.0)
    port = httpd.server_address[1]
    try:
        assert asyncio.run(fetcher.fetch(f"https://127.0.0.1:{port}/image.png", "mm_items[0]")) == images[2]
        started = time.monotonic()
        with pytest.raises(Unavailable, match=r"took over 2 s"):
            asyncio.run(fetcher.fetch(f"https://127.0.0.1:{port}/slow.png", "mm_items[0]"))
        assert time.monotonic() - started < 20
        assert _TlsHandler.ended.wait(30)
    finally:
        fetcher.close()
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sglang-tokens") / "tokens"
    path.write_text("token-a\ntoken-b\ntoken-c\n")
    return path


@pytest.fixture(scope="module")
def secured(start_encoder_server, sg, token_file):
    """Tokens and one Encode per client on both ports."""
    s = start_encoder_server("--sglang-compat-port", "0", "--allowed-sinks", "127.0.0.1:*",
                             "--auth-token-file", str(token_file), "--max-requests-per-client", "1")
    s.sglang_target = f"127.0.0.1:{_sglang_port(s)}"
    yield s
    s.stop()


def test_tokens_are_checked_on_the_sglang_port(sg, secured, images):
    """SGLang's own client sends no token (grpc.insecure_channel, no metadata): with
    --auth-token-file it is refused on this port too, as any caller without a token."""
    url = f"grpc://{secured.sglang_target}"
    for call in (lambda: _encode(sg, types.SimpleNamespace(sglang_url=url), [_data_url(images[0])], [1]),
                 lambda: asyncio.run(sg.receiver._grpc_scheduler_receive_url(secured.sglang_target, "r",
                                                                             "127.0.0.1:9", 1))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in err.value.details()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        with grpc.insecure_channel(secured.sglang_target) as channel:
            with pytest.raises(grpc.RpcError) as err:
                _stub(channel).Encode(_request(images[0], "wrong", [port]), metadata=_bearer("nope"), timeout=60)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            response = _stub(channel).Encode(_request(images[0], "right", [port]), metadata=_bearer("token-a"),
                                             timeout=60)
        assert sock.poll(30_000) and response.embedding_len > 0
    finally:
        sock.close(linger=0)
        ctx.term()


def test_the_per_client_limit_holds_on_the_sglang_port(sg, secured, images):
    from smg_grpc_proto import sglang_encoder_pb2

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        with grpc.insecure_channel(secured.sglang_target) as channel:
            stub = _stub(channel)
            # No port: it waits for the ranks' registrations, holding token-a's one Encode.
            held = stub.Encode.future(_request(images[0], "held"), metadata=_bearer("token-a"), timeout=60)
            deadline = time.monotonic() + 30
            while secured.metric("encoder_service_requests_in_flight") < 1:
                assert time.monotonic() < deadline, "the held Encode never started"
                time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as err:
                stub.Encode(_request(images[0], "second", [port]), metadata=_bearer("token-a"), timeout=60)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-requests-per-client 1" in err.value.details()
            # Another client is served meanwhile.
            assert stub.Encode(_request(images[0], "other", [port]), metadata=_bearer("token-b"),
                               timeout=60).embedding_len > 0
            assert sock.poll(30_000)
            sock.recv_multipart()
            # The held one's receiver registers: it is pushed and ends OK, and token-a is served again.
            stub.SchedulerReceiveUrl(sglang_encoder_pb2.SchedulerReceiveUrlRequest(
                req_id="held", receive_url=f"127.0.0.1:{port}", receive_count=1), metadata=_bearer("token-a"),
                timeout=60)
            assert held.result(timeout=60).embedding_len > 0
            assert stub.Encode(_request(images[0], "again", [port]), metadata=_bearer("token-a"),
                               timeout=60).embedding_len > 0
    finally:
        sock.close(linger=0)
        ctx.term()


# One 56x56 image of the tiny preset: 4 tokens of 48 float32 values, 768 bytes. Room for one.
HELD_BYTES = 1000
SEND_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def bounded(start_encoder_server, sg, token_file):
    """Held embeddings bounded to one small request, for 5 s; tokens on the main port only."""
    s = start_encoder_server("--sglang-compat-port", "0", "--allowed-sinks", "127.0.0.1:*",
                             "--auth-token-file", str(token_file), "--sglang-compat-tokens", "off",
                             "--sglang-max-held-bytes", str(HELD_BYTES),
                             "--sglang-send-timeout-s", str(SEND_TIMEOUT_S))
    s.sglang_url = f"grpc://127.0.0.1:{_sglang_port(s)}"
    yield s
    s.stop()


def test_held_embeddings_are_bounded_in_bytes_and_time(sg, bounded, images):
    """An Encode whose receivers never register holds its embeddings until --sglang-send-timeout-s,
    and meanwhile others that would hold more than --sglang-max-held-bytes are refused; a request
    over the budget by itself is refused for good. SGLang's own client is served on this port, the
    tokens (--sglang-compat-tokens off) being for the main port only."""
    with pytest.raises(EncoderClientError) as err, EncoderClient(bounded.target, timeout_s=30, retries=0) as client:
        client.encode([images[0]])  # the main port still wants a token
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED

    held_result: list = []

    def hold() -> None:
        """An Encode no rank registers for; tried again while a push beside it has the budget."""
        for _ in range(50):
            started = time.monotonic()
            result = _call(lambda: _encode(sg, bounded, [_data_url(images[0])], [], req_id="never-registered"))
            if result[0] != "RESOURCE_EXHAUSTED":
                break
        held_result.append((*result, time.monotonic() - started))

    held = threading.Thread(target=hold)
    held.start()
    refused = None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        # Until the first one holds its bytes, another one is pushed (to a live receiver) and ends.
        while refused is None and held.is_alive():
            try:
                _encode(sg, bounded, [_data_url(images[0])], [port], req_id="beside")
                sock.recv_multipart()
                time.sleep(0.1)
            except grpc.RpcError as exc:
                refused = exc
        assert refused is not None, f"nothing was refused while an Encode held its embeddings: {held_result}"
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--sglang-max-held-bytes" in refused.details()
        assert dict(refused.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"

        held.join(60)
        assert not held.is_alive()
        code, details, took_s = held_result[0]
        assert code == "UNAVAILABLE" and "never-registered" in details and "--sglang-send-timeout-s" in details
        assert took_s < 60  # 5 s, with room for a loaded machine (SGLang's own encoder holds them 180 s)

        # The bytes were given back: the next one is served.
        response = _encode(sg, bounded, [_data_url(images[0])], [port], req_id="after")
        assert sock.poll(30_000) and response.embedding_size == 768
        sock.recv_multipart()

        # 6 tokens (84x56): 1152 bytes, more than the whole budget: refused, not to be retried.
        with pytest.raises(grpc.RpcError) as err:
            _encode(sg, bounded, [_data_url(images[1])], [port], req_id="too-big")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--sglang-max-held-bytes 1000" in err.value.details()
        assert dict(err.value.trailing_metadata())["grpc-retry-pushback-ms"] == "-1"
    finally:
        held.join(60)
        sock.close(linger=0)
        ctx.term()


def _call(call) -> tuple[str, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code().name, exc.details()
    return "OK", ""


def test_registrations_are_bounded_per_source_and_in_all():
    """The table behind SchedulerReceiveUrl: a source over its share replaces its own oldest
    registrations; a full table makes room from the source holding the most; registrations an
    Encode waits on are never dropped, and when nothing can be dropped the refusal says why."""
    from encoder_service.api.sglang.zmq_push import Destinations
    from encoder_service.errors import InvalidInput, ResourceExhausted

    table = Destinations(ttl_s=60, max_pending=5, max_per_source=3)
    for i in range(10):  # a flood from one source keeps only its 3 latest
        table.register(f"junk-{i}", "tcp://127.0.0.1:9", 2, "client 10.0.0.66")
    assert table.count("client 10.0.0.66") == 3 and len(table) == 3
    table.register("a-1", "tcp://127.0.0.1:9", 2, "client 10.0.0.1")
    table.register("b-1", "tcp://127.0.0.1:9", 2, "client 10.0.0.2")
    table.register("c-1", "tcp://127.0.0.1:9", 2, "client 10.0.0.3")  # full: one of the flood's goes
    assert table.count("client 10.0.0.66") == 2 and len(table) == 5
    for source in ("client 10.0.0.1", "client 10.0.0.2", "client 10.0.0.3"):
        assert table.count(source) == 1

    # Of a source's own, one whose embeddings were delivered goes before older pending ones.
    mine = Destinations(ttl_s=60, max_pending=10, max_per_source=3)
    for req_id in ("r-0", "r-1", "r-2"):
        mine.register(req_id, "tcp://127.0.0.1:9", 1, "client 10.0.0.1")
    with mine.expecting("r-1", "client 10.0.0.1") as entry:
        entry.delivered = True  # what Encode marks once it pushed
    mine.register("r-3", "tcp://127.0.0.1:9", 1, "client 10.0.0.1")
    assert sorted(mine._entries) == ["r-0", "r-2", "r-3"]

    # Registrations Encode calls wait on stay; with nothing else to drop, a new one is refused.
    full = Destinations(ttl_s=60, max_pending=2, max_per_source=2)
    with full.expecting("r-1", "client 10.0.0.1"), full.expecting("r-2", "client 10.0.0.1"):
        with pytest.raises(ResourceExhausted, match="SchedulerReceiveUrl"):
            full.register("r-3", "tcp://127.0.0.1:9", 1, "client 10.0.0.2")
        full.register("r-1", "tcp://127.0.0.1:9", 1, "client 10.0.0.2")  # an existing one: no room needed
    assert full.count("client 10.0.0.1") == 2

    # A req_id takes at most receive_count receivers, and receive_count is bounded.
    table.register("ranks", "tcp://127.0.0.1:1", 2, "client 10.0.0.1")
    table.register("ranks", "tcp://127.0.0.1:2", 2, "client 10.0.0.1")
    table.register("ranks", "tcp://127.0.0.1:2", 2, "client 10.0.0.1")  # the same one again: fine
    with pytest.raises(InvalidInput, match="already has its 2 receivers"):
        table.register("ranks", "tcp://127.0.0.1:3", 2, "client 10.0.0.1")
    with pytest.raises(InvalidInput, match="receive_count"):
        table.register("many", "tcp://127.0.0.1:3", 100_000, "client 10.0.0.1")


def test_the_sglang_port_shares_the_main_ports_token_file_and_client_counts(tmp_path):
    from encoder_service.api.security.auth import TokenAuthInterceptor
    from encoder_service.api.security.client_limits import PerClientLimitInterceptor
    from encoder_service.api.security.settings import build_security, sglang_port_security
    from encoder_service.api.sglang.front_end import LIMITED_METHODS
    from encoder_service.config_flags import parse_serve_args

    tokens = tmp_path / "tokens"
    tokens.write_text("t\n")
    flags = ["--sglang-compat-port", "0", "--auth-token-file", str(tokens), "--max-requests-per-client", "2"]
    for setting, by_token in (("on", True), ("off", False)):
        config = parse_serve_args([*flags, "--sglang-compat-tokens", setting], environ={})
        security = build_security(config.security)
        port = sglang_port_security(config.sglang, config.security, security, LIMITED_METHODS)
        kinds = [type(i) for i in port.interceptors]
        assert kinds == ([TokenAuthInterceptor] if by_token else []) + [PerClientLimitInterceptor]
        assert port.by_token is by_token and port.interceptors[-1].by_token is by_token
        if by_token:
            assert port.interceptors[0].tokens is security.tokens  # the same file, re-read in one place
        limiter = port.interceptors[-1]
        assert limiter.methods == {"/sglang.grpc.encoder.SglangEncoder/Encode"}
        assert limiter.limits is security.client_limits  # one count per client across both ports
