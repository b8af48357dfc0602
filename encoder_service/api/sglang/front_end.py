"""The SGLang-compatible front end (``--sglang-compat-port``): SGLang's own encoder protocol.

An SGLang language server started with ``--language-only --encoder-urls grpc://HOST:PORT`` and
``SGLANG_ENCODER_MM_RECEIVER_MODE=grpc`` calls ``sglang.grpc.encoder.SglangEncoder`` (the
``smg-grpc-proto`` package's ``sglang_encoder.proto``) and receives the embeddings over ZMQ. This
module serves that service on its own port, next to VisionEncoder, as SGLang's encoder server
does (``sglang/srt/disaggregation/encoder/grpc_server.py``, SGLang 0.5.23):

- ``Encode``: ``mm_items`` (image URLs, api/sglang/media.py) are encoded through the same engine
  path as our Encode (cache, batching, admission: ``EngineGate.encode_all``, api/engine_gate.py), then
  this part (``num_parts``, ``part_idx``, as the language server split the request across its
  encoders) is pushed as two ZMQ frames, a pickled ``EmbeddingData`` header
  (api/sglang/header.py) and the rows' raw bytes, to ``prefill_host:embedding_port`` for every
  port given, or, with none, to every scheduler rank that registered with ``SchedulerReceiveUrl``
  (api/sglang/zmq_push.py). The call returns once every receiver has the data. Computed embeddings wait
  for their receivers at most ``--sglang-send-timeout-s`` (the ranks' registrations and the
  pushes together), and at most ``--sglang-max-held-bytes`` of them in all: over it the call is
  RESOURCE_EXHAUSTED (with a retry pushback, or none for a request over the budget by itself).
- ``SchedulerReceiveUrl``: registers a receiver for a req_id, counted against its caller's share
  of the registrations (its token where this port checks tokens, else its IP address).
- ``Send`` is the Mooncake (RDMA) path, which SGLang's gRPC receiver refuses: UNIMPLEMENTED.

The port checks the main port's bearer tokens (``--auth-token-file``, unless
``--sglang-compat-tokens off``) and per-client limits (``--max-requests-per-client``, one count per
client across both ports), with the interceptors of api/security/settings.py. Errors are typed
(``EncoderError``) and become statuses in the service interceptor, as on the main port, so every
bad input is a status naming it and the server serves on. The response's trailing metadata carries
each image's SGLang content digest (``x-mm-content-hashes``: ``sha256:<hex of the raw bytes>``,
what SGLang's routers send as ``mm_content_hashes``) and our namespaced cache key
(``x-encoder-content-hashes``), comma-separated in item order; the pushed header carries the same
two lists as ``mm_content_hashes`` and ``encoder_content_hashes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import types

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from smg_grpc_proto import sglang_encoder_pb2, sglang_encoder_pb2_grpc

from ...config import RequestLimits, SecurityConfig, SglangConfig
from ...engine import ImageInput
from ...errors import EncoderError, InvalidInput
from ...metrics import ServiceMetrics
from ..engine_gate import EngineGate
from ..interceptor_support import method_path
from ..security.auth import client_identity, presented_token
from ..security.client_limits import peer_address
from ..security.settings import Security, sglang_port_security
from ..service_interceptor import CallBook, ServiceInterceptor
from .header import embedding_data_header
from .media import load_mm_items, sglang_content_hash
from .url_fetch import UrlFetcher
from .zmq_push import Destinations, HeldBytes, ZmqPusher, checked_endpoint, host_port

log = logging.getLogger(__name__)

SGLANG_ENCODER = sglang_encoder_pb2.DESCRIPTOR.services_by_name["SglangEncoder"]
LABEL_PREFIX = "sglang."  # encoder_service_requests_total{method="sglang.Encode"}
# The calls --max-requests-per-client counts on this port: Encode holds the server's work.
LIMITED_METHODS = frozenset({method_path(SGLANG_ENCODER.methods_by_name["Encode"])})
MAX_REQ_ID_CHARS = 256


class Unimplemented(EncoderError):
    code = "UNIMPLEMENTED"


def _check(request: sglang_encoder_pb2.EncodeRequest, max_images: int) -> None:
    """What SGLang's ``validate_encode_request`` checks, plus our limits."""
    if not request.req_id or len(request.req_id) > MAX_REQ_ID_CHARS:
        raise InvalidInput(f"req_id must be 1..{MAX_REQ_ID_CHARS} characters, got {len(request.req_id)}")
    if not request.mm_items:
        raise InvalidInput("mm_items is empty")
    if len(request.mm_items) > max_images:
        raise InvalidInput(f"{len(request.mm_items)} mm_items in one request; at most {max_images} "
                           "(--max-images-per-request)")
    if request.num_parts <= 0:
        raise InvalidInput("num_parts must be a positive integer")
    if request.part_idx >= request.num_parts:
        raise InvalidInput(f"part_idx must be in [0, {request.num_parts}), got {request.part_idx}")


class SglangEncoderServicer(sglang_encoder_pb2_grpc.SglangEncoderServicer):
    def __init__(self, sglang: SglangConfig, requests: RequestLimits, gate: EngineGate, by_token: bool = False) -> None:
        """``sglang``: this port's settings; ``requests``: the limits a call has on either port;
        ``gate``: the engine path, its readiness and drain, shared with the VisionEncoder port;
        ``by_token``: this port checks bearer tokens, so a caller is its token."""
        self.requests = requests
        self.gate = gate
        self.sinks = requests.sink_allowlist
        self.fetcher = UrlFetcher(sglang.url_fetch_allowlist, requests.max_message_bytes)
        self.send_timeout_s = sglang.send_timeout_s
        self.destinations = Destinations(ttl_s=self.send_timeout_s)
        self.held = HeldBytes(sglang.max_held_bytes)
        self.pusher = ZmqPusher()
        self.by_token = by_token

    def _caller(self, context: grpc.aio.ServicerContext) -> str:
        """Who a call counts against, as per-client limits tell callers apart: the accepted token's
        identity where this port checks tokens, else the peer's IP address."""
        if self.by_token:
            token = presented_token(types.SimpleNamespace(invocation_metadata=context.invocation_metadata()))
            if token is not None:
                return client_identity(token)
        return "client " + peer_address(context.peer())

    async def _push(self, endpoints: list[str], frames: list[bytes], deadline: float) -> None:
        """Every push, each until ``deadline`` (loop time); the first failure cancels the others."""
        loop = asyncio.get_running_loop()
        pushes = [asyncio.ensure_future(self.pusher.push(e, frames, deadline - loop.time())) for e in endpoints]
        try:
            await asyncio.gather(*pushes)
        finally:
            for push in pushes:
                push.cancel()

    async def Encode(self, request: sglang_encoder_pb2.EncodeRequest,
                     context: grpc.aio.ServicerContext) -> sglang_encoder_pb2.EncodeResponse:
        _check(request, self.requests.max_images_per_request)
        # Receivers named in the request are checked before any work; registered ones as they come.
        ports = list(request.embedding_port)
        endpoints = [checked_endpoint(host_port(request.prefill_host, p), self.sinks, "prefill_host:embedding_port")
                     for p in ports]
        # zmq_to_scheduler: the ranks register (before, during or after the encode) into this entry.
        expecting = (self.destinations.expecting(request.req_id, self._caller(context)) if not endpoints
                     else contextlib.nullcontext())
        with expecting as entry:
            blobs = await load_mm_items(list(request.mm_items), self.fetcher)
            images = [ImageInput(index=i, kind="encoded", data=b) for i, b in enumerate(blobs)]
            encoded = await self.gate.encode_all(images)
            results = [r for r, _ in encoded]
            sglang_hashes = [sglang_content_hash(b) for b in blobs]
            del blobs, images
            with self.held.hold(sum(len(data) for _, data in encoded)):
                payload = b"".join(data for _, data in encoded)
                del encoded  # the payload is the one copy held
                loop = asyncio.get_running_loop()
                deadline = loop.time() + self.send_timeout_s
                if entry is not None:
                    endpoints = await self.destinations.receivers(
                        entry, request.req_id, self.send_timeout_s,
                        "(--sglang-send-timeout-s); the embeddings are dropped")
                num_tokens = sum(r.num_tokens for r in results)
                row_width = results[0].row_width
                ours = [r.content_hash for r in results]
                header = embedding_data_header(
                    request.req_id, request.num_parts, request.part_idx, [r.grid for r in results], num_tokens,
                    row_width, self.gate.engine.describe().dtype,
                    mm_content_hashes=sglang_hashes, encoder_content_hashes=ours)
                await self._push(endpoints, [header, payload], deadline)
                if entry is not None:
                    entry.delivered = True
        log.debug("sglang Encode %s part %d/%d: %d images, %d tokens -> %s", request.req_id, request.part_idx,
                  request.num_parts, len(results), num_tokens, ", ".join(endpoints))
        context.set_trailing_metadata((("x-mm-content-hashes", ",".join(sglang_hashes)),
                                       ("x-encoder-content-hashes", ",".join(ours))))
        return sglang_encoder_pb2.EncodeResponse(embedding_size=len(payload), embedding_len=num_tokens,
                                                 embedding_dim=row_width)

    async def SchedulerReceiveUrl(self, request: sglang_encoder_pb2.SchedulerReceiveUrlRequest,
                                  context: grpc.aio.ServicerContext) -> sglang_encoder_pb2.SchedulerReceiveUrlResponse:
        if not request.req_id or len(request.req_id) > MAX_REQ_ID_CHARS:
            raise InvalidInput(f"req_id must be 1..{MAX_REQ_ID_CHARS} characters, got {len(request.req_id)}")
        if request.receive_count <= 0:
            raise InvalidInput("receive_count must be a positive integer")
        endpoint = checked_endpoint(request.receive_url, self.sinks, "receive_url")
        self.destinations.register(request.req_id, endpoint, request.receive_count, self._caller(context))
        return sglang_encoder_pb2.SchedulerReceiveUrlResponse()

    async def Send(self, request: sglang_encoder_pb2.SendRequest,
                   context: grpc.aio.ServicerContext) -> sglang_encoder_pb2.SendResponse:
        raise Unimplemented("Send is SGLang's Mooncake (RDMA) path, which this encoder does not offer; "
                            "Encode pushes the embeddings over ZMQ (zmq_to_tokenizer / zmq_to_scheduler)")


class SglangCompatServer:
    """The extra gRPC server on ``--sglang-compat-port``: SglangEncoder and the health service."""

    def __init__(self, server: grpc.aio.Server, servicer: SglangEncoderServicer, port: int) -> None:
        self.server, self.servicer, self.port = server, servicer, port

    @classmethod
    async def start(cls, host: str, sglang: SglangConfig, requests: RequestLimits, settings: SecurityConfig,
                    gate: EngineGate, metrics: ServiceMetrics, calls: CallBook,
                    health_servicer: health.aio.HealthServicer, options: list[tuple[str, int]],
                    security: Security) -> SglangCompatServer:
        """Raises RuntimeError when the port cannot be bound; ``host``: the main port's address;
        ``options``: the main port's; ``security`` (built from ``settings``): the main port's (its
        token file and per-client counts are shared)."""
        port_security = sglang_port_security(sglang, settings, security, LIMITED_METHODS)
        compat = SglangEncoderServicer(sglang, requests, gate, by_token=port_security.by_token)
        # The service interceptor first, as on the main port: it answers the others' refusals.
        server = grpc.aio.server(options=options, interceptors=[
            ServiceInterceptor(metrics, calls, SGLANG_ENCODER, LABEL_PREFIX), *port_security.interceptors])
        sglang_encoder_pb2_grpc.add_SglangEncoderServicer_to_server(compat, server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_insecure_port(f"{host}:{sglang.port}")
        await server.start()
        log.info("SGLang-compatible encoder (sglang.grpc.encoder.SglangEncoder, plaintext) on %s:%d; %s; "
                 "pushes to --allowed-sinks only; embeddings held for delivery: at most %d bytes, %g s; "
                 "URL fetch: %s", host, port, "; ".join(port_security.summary),
                 sglang.max_held_bytes, sglang.send_timeout_s,
                 sglang.allow_url_fetch or "off (data URLs only)")
        return cls(server, compat, port)

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)
        self.servicer.pusher.close()
        self.servicer.fetcher.close()
