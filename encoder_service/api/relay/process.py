"""A relay process of ``--grpc-processes``: serves the public gRPC port and passes every call on to
the server process over its private unix socket.

Why: gRPC's C core copies each response message and writes it to the socket on the thread that
calls ``write``; in an asyncio server that is the one event-loop thread, in the process that also
decodes, hashes, caches and batches. Streaming 9.3 MB a 1008x1008 image, one Python process stopped
at 72-124 images/s on a 16-core H100 host, while the same process writing into shared memory did
217 (bench/RESULTS.md). So with N relays the server process writes each embedding once into a
relay's shared-memory region, and the relay streams it to the caller in its own process: the
streaming scales with N, and the cache, the batch queue and the metrics stay one.

What a relay does with a call:
- **Encode asking for streamed responses** (no ``output_region``, no ``sink``): the relay lends the
  server one of its regions (sealed memfds handed over by descriptor, named in the call's metadata
  by an opaque key: api/relay/regions.py), and sends each image it reads there on as the chunks the
  server would have streamed: the same messages, byte for byte (``streaming.rows_on_stream``). An
  image that did not fit the region comes on the stream and passes as it came. Regions are sized
  for recent calls up to ``REGION_MAX_BYTES``, and a relay's regions hold at most
  ``REGIONS_MAX_BYTES``; a call beyond that passes as sent (the server streams it through).
- **Everything else the server serves** (Encode with the caller's own region or a sink, Lookup,
  GetModelInfo, health, reflection): bytes in, bytes out, unchanged. A method the server does not
  serve is answered UNIMPLEMENTED here, by gRPC, as the server would.
Metadata goes upstream as sent (bearer tokens are checked by the server process, which also
counts per-client limits by the caller's peer, set here under ``RELAYED_PEER``), with the caller's
deadline; status, details and trailing metadata come back as the server answered. TLS ends here,
with the server's certificate files (each relay re-reads them when they change).

The relay imports neither torch nor the engine. It stops when its server process tells it to (a
``("stop", grace_s)`` message: ``server.stop`` with that grace) or when its pipe closes (the server
process died: stop at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection

import grpc
from encoder_client.protocol import encoder_pb2
from encoder_client.protocol.chunks import parse_chunk, row_bytes
from encoder_client.shared_memory import RegionPool, aligned
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from ...config import RelayConfig, RequestLimits, SecurityConfig, chunk_budget
from ...metrics import VISION_ENCODER
from ..interceptor_support import RELAYED_PEER, method_path
from ..security.tls import ReloadingServerCredentials
from ..streaming import OFF_LOOP_MIN_BYTES, built_off_loop, rows_on_stream
from .regions import RELAY_REGION, RegionLender

log = logging.getLogger(__name__)

ENCODE = method_path(VISION_ENCODER.methods_by_name["Encode"])
# What the server process serves (api/server.py registers these services): method -> whether
# its requests are a stream.
_SERVED = {method_path(m): m.client_streaming
           for service in (VISION_ENCODER, health_pb2.DESCRIPTOR.services_by_name["Health"],
                           reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"])
           for m in service.methods}
# Set by gRPC itself on each call, or naming the connection: not passed on.
_TRANSPORT_KEYS = frozenset({"content-type", "te", "user-agent", "grpc-accept-encoding", "grpc-encoding",
                             "grpc-timeout", RELAYED_PEER, RELAY_REGION})
# One region holds a call of up to 7 images of a 7B model at 1008x1008 (8.8 MB each); a larger
# call's other images come on the stream. All of a relay's regions together hold at most
# REGIONS_MAX_BYTES (64 concurrent calls of one such image each): beyond, calls pass through and
# the server streams them, so callers that stop reading cannot pin /dev/shm without bound.
REGION_MAX_BYTES = 64 << 20
REGIONS_MAX_BYTES = 1 << 30


# Ends of an upstream call that this side may see before the server's handler stopped writing.
_SERVER_MAY_STILL_WRITE = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True)
class RelaySpec:
    """What the server process hands one relay: its group of the config and the two it shares with the
    main port (``requests``: the message and chunk sizes; ``security``: the port's TLS), not the whole
    config."""

    relays: RelayConfig
    requests: RequestLimits
    security: SecurityConfig
    upstream: str  # the server process's address: unix:/path
    regions_path: str  # the server process's region socket (api/relay/regions.py)
    port: int  # the public port to bind (0 for the first relay when --port 0)
    index: int


def upstream_metadata(metadata, peer: str) -> tuple[tuple[str, str | bytes], ...]:
    """The caller's metadata as passed on: gRPC's own keys left out, the caller's peer added."""
    kept = tuple((k, v) for k, v in metadata or () if k not in _TRANSPORT_KEYS and not k.startswith(":"))
    return (*kept, (RELAYED_PEER, peer))


class Relay(grpc.GenericRpcHandler):
    """Every method of the public port, passed on to ``channel`` (see the module docstring)."""

    def __init__(self, channel: grpc.aio.Channel, lender: RegionLender, max_chunk_bytes: int) -> None:
        self._channel = channel
        self._lender = lender
        self._regions = RegionPool(max_region_bytes=REGION_MAX_BYTES, max_total_bytes=REGIONS_MAX_BYTES,
                                   create=lender.create)
        self._max_chunk_bytes = max_chunk_bytes
        self._copies = ThreadPoolExecutor(max_workers=4, thread_name_prefix="relay-copy")
        self._region_failure_logged = False

    def service(self, details: grpc.HandlerCallDetails):
        if details.method == ENCODE:
            return grpc.unary_stream_rpc_method_handler(self._encode)
        streams_requests = _SERVED.get(details.method)
        if streams_requests is None:
            return None  # gRPC answers UNIMPLEMENTED, as the server would
        # Responses as a stream either way: on the wire a single response is a stream of one. A
        # single request is read before the call goes on, so the upstream call never reads the
        # caller's request stream (an upstream answer while it still did broke the caller's call).
        if streams_requests:
            return grpc.stream_stream_rpc_method_handler(functools.partial(self._pass_on, details.method))
        return grpc.unary_stream_rpc_method_handler(functools.partial(self._pass_on_one, details.method))

    def close(self) -> None:
        self._copies.shutdown(wait=False)
        self._regions.close()
        self._lender.close()

    # --- any method ----------------------------------------------------------------------------------
    async def _pass_on(self, method: str, requests, context: grpc.aio.ServicerContext) -> None:
        await self._relayed(self._channel.stream_stream(method), requests, context)

    async def _pass_on_one(self, method: str, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        await self._relayed(self._channel.unary_stream(method), raw, context)

    async def _relayed(self, multi_callable, request, context: grpc.aio.ServicerContext) -> None:
        """One call to the server (a request, or a stream of them) with the caller's metadata and
        deadline, its answer relayed as it comes."""
        call = multi_callable(request, metadata=upstream_metadata(context.invocation_metadata(), context.peer()),
                              timeout=context.time_remaining())
        try:
            failure = await _relay_call(call, context, _write_each(call, context))
            if failure is not None:
                await _abort_like(context, failure)
        finally:
            call.cancel()  # a no-op once it ended; after the abort (see _relay_call)

    # --- Encode ----------------------------------------------------------------------------------------
    async def _encode(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        request, region = self._with_region(raw)
        if region is None:
            await self._pass_on_one(ENCODE, raw, context)
            return
        budget = chunk_budget(request.max_chunk_bytes, self._max_chunk_bytes)
        lend = self._lender.lend(region)
        metadata = (*upstream_metadata(context.invocation_metadata(), context.peer()), (RELAY_REGION, lend))
        call = self._channel.unary_stream(ENCODE)(raw, metadata=metadata, timeout=context.time_remaining())
        needed = [0]
        reusable = False
        try:
            try:
                failure = await _relay_call(call, context,
                                            self._stream_from_region(call, context, region, budget, needed))
                reusable = failure is None or failure.code() not in _SERVER_MAY_STILL_WRITE
            finally:
                # The caller has every chunk (or is gone): the server may end its per-client slot.
                self._lender.give_back(lend)
                # A region whose call the server may not have finished is dropped, not reused.
                self._regions.release(region, needed_bytes=needed[0], failed=not reusable)
            if failure is not None:
                await _abort_like(context, failure)
        finally:
            call.cancel()

    def _with_region(self, raw: bytes):
        """(the request, one of our regions for it), or (None, None) when the call passes as sent:
        it names its own region or a sink, asks for no rows (cache_only), does not parse (the server
        answers that), or no region can be had (the server then streams)."""
        try:
            request = encoder_pb2.EncodeRequest.FromString(raw)
        except DecodeError:
            return None, None
        if request.HasField("output_region") or request.HasField("sink") or request.cache_only:
            return None, None  # cache_only: headers only, no rows to carry
        try:
            region = self._regions.acquire()
        except OSError as exc:
            if not self._region_failure_logged:
                self._region_failure_logged = True
                log.warning("relay: no shared-memory region (%s); the server streams responses itself", exc)
            return None, None
        if not self._lender.current(region):  # registered through a connection since ended: streamed
            self._regions.release(region, needed_bytes=0, failed=True)  # the next call makes a new one
            return None, None
        return request, region

    async def _stream_from_region(self, call, context: grpc.aio.ServicerContext, region, budget: int,
                                  needed: list[int]) -> None:
        async for raw in call:
            chunk = parse_chunk(raw)
            if not chunk.region_bytes:  # on the stream already (did not fit the region): as it came
                if chunk.last:
                    needed[0] += aligned(chunk.num_tokens * row_bytes(chunk))
                await context.write(raw)
                continue
            rows = region.view(chunk.region_offset, chunk.region_bytes)
            if rows is None:
                raise RuntimeError(f"the server placed image {chunk.image_index} outside the relay's region")
            needed[0] += aligned(chunk.region_bytes)
            chunks = rows_on_stream(chunk.header, rows, budget)
            if chunk.region_bytes >= OFF_LOOP_MIN_BYTES:
                async with contextlib.aclosing(built_off_loop(chunks, self._copies)) as built:
                    async for message in built:
                        await context.write(message)
            else:
                for message in chunks:
                    await context.write(message)


async def _write_each(call, context: grpc.aio.ServicerContext) -> None:
    async for message in call:
        await context.write(message)


async def _relay_call(call, context: grpc.aio.ServicerContext, forwarding) -> grpc.aio.AioRpcError | None:
    """Runs ``forwarding`` (which reads ``call`` and writes to ``context``); None when the server
    ended the upstream call OK (its trailing metadata set on the caller's), else its error.

    The caller cancels ``call`` when done with it (a no-op once it ended; what ends it when the
    caller's own call is cancelled), and only after answering its caller: a cancel while the
    upstream call still reads the caller's request stream breaks the caller's call (INTERNAL)."""
    try:
        await forwarding
        trailing = await call.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(tuple(trailing))
        return None
    except grpc.aio.AioRpcError as err:
        return err


async def _abort_like(context: grpc.aio.ServicerContext, err: grpc.aio.AioRpcError) -> None:
    """Ends the caller's call as the server ended the upstream one: status, details, trailers."""
    await context.abort(err.code(), err.details() or "", tuple(err.trailing_metadata() or ()))


def relay_options(requests: RequestLimits) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", requests.max_message_bytes),
            ("grpc.max_send_message_length", requests.max_message_bytes),
            ("grpc.so_reuseport", 1)]  # the relays share the port; the kernel spreads connections


async def serve_relay(spec: RelaySpec, conn: Connection) -> int:
    requests, security = spec.requests, spec.security
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[float] = loop.create_future()

    def on_message() -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = ("stop", 0.0)  # the server process is gone: nothing to drain for
        if message[0] == "stop" and not stop.done():
            loop.remove_reader(conn.fileno())
            stop.set_result(float(message[1]))

    channel_options = [("grpc.max_receive_message_length", requests.max_message_bytes),
                       ("grpc.max_send_message_length", requests.max_message_bytes)]
    channel = grpc.aio.insecure_channel(spec.upstream, options=channel_options)
    try:
        lender = RegionLender(spec.regions_path)
    except OSError as exc:
        conn.send(("failed", f"relay {spec.index} cannot reach the server's region socket: {exc}"))
        await channel.close()
        return 1
    relay = Relay(channel, lender, requests.max_chunk_bytes)
    server = grpc.aio.server(options=relay_options(requests))
    server.add_generic_rpc_handlers((relay,))
    address = f"{spec.relays.host}:{spec.port}"
    try:
        if security.tls:
            credentials = ReloadingServerCredentials(security.tls_cert, security.tls_key,
                                                     security.tls_client_ca).credentials
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
        await server.start()
    except Exception as exc:
        conn.send(("failed", f"relay {spec.index} cannot serve {address}: {exc}"))
        relay.close()
        await channel.close()
        return 1
    conn.send(("listening", port))
    loop.add_reader(conn.fileno(), on_message)
    grace_s = await stop
    await server.stop(grace_s)
    relay.close()
    await channel.close()
    return 0


def relay_main(spec: RelaySpec, conn: Connection) -> None:
    """The relay process's entry point (started with spawn by api/relay/supervisor.py)."""
    logging.basicConfig(level=spec.relays.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s relay-{spec.index} %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group; the server process drains, then stops the relays.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = asyncio.run(serve_relay(spec, conn))
    logging.shutdown()
    sys.exit(code)
