"""The VisionEncoder gRPC service: checks requests, hands them to the engine, streams the results.

Methods raise typed errors; the service interceptor (api/service_interceptor.py) answers them as statuses and
records the request metrics."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from encoder_client.protocol import encoder_pb2, encoder_pb2_grpc

from ..config import RequestLimits, SecurityConfig
from ..engine import Engine, ImageResult
from ..engine.fair_slots import Caller
from ..errors import InvalidInput, ResourceExhausted
from ..memory import host_has_swap
from ..metrics import ServiceMetrics
from .caller_regions import CallerRegions
from .engine_gate import EngineGate
from .relay.regions import RELAY_REGION, RegionBoard
from .security.client_limits import client_of
from .service_interceptor import CallBook
from .shared_memory import DescriptorWriter, RegionTable, RegionUnusable, RegionWriter
from .sink_push import PUSH_MAX_CHUNK_BYTES, SinkChannels, SinkFailed, SinkPush, fail_uniformly, header_chunk
from .streaming import (
    ALONE_REGION_BYTES,
    ALONE_STREAM_BYTES,
    OFF_LOOP_MIN_BYTES,
    built_off_loop,
    embedding_chunks,
    region_chunk,
    serialized_chunks,
)
from .validation import EncodePlan, parse_encode_request

log = logging.getLogger(__name__)

MAX_LOOKUP_HASHES = 65536
# Lookup answers this many hashes at a time and lets the event loop run between slices: the loop
# answers every call (health checks too), and 65536 hashes at once held it for tens of ms.
LOOKUP_SLICE = 2048
# Ids for requests that came without one: unique per process and cheap (uuid4 reads os.urandom).
_ID_PREFIX = f"{os.getpid():x}-{os.urandom(4).hex()}"
_ids = itertools.count()


class VisionEncoderServicer(encoder_pb2_grpc.VisionEncoderServicer):
    """Serves once its gate is open (model loaded and warmed); UNAVAILABLE before and while draining."""

    def __init__(self, requests: RequestLimits, security: SecurityConfig, metrics: ServiceMetrics, calls: CallBook,
                 *, shared_memory: bool, gate: EngineGate | None = None, relay_regions: RegionBoard | None = None,
                 sink_credentials: grpc.ChannelCredentials | None = None,
                 caller_regions: CallerRegions | None = None) -> None:
        """Two groups of the config, not the whole: ``requests``, what one call may ask (message, chunk
        and request sizes, the sinks and their bound), and ``security``, whom a call counts against
        (tokens, relays) and whether sinks need TLS; ``shared_memory``: --shared-memory on (callers may
        name their own region). ``gate``: the engine's readiness, shared with the server's other front
        ends (by default one of this servicer's own over ``calls``); ``sink_credentials``: toward the
        sinks (``Security.sink_credentials``, from --sink-tls-*; None: plaintext); ``caller_regions``:
        the regions callers on this host registered by descriptor (api/caller_regions.py; None: none
        taken, and GetModelInfo names no region socket)."""
        if security.sink_tls and sink_credentials is None:
            raise ValueError("--sink-tls-* is set: the servicer needs its credentials (Security.sink_credentials)")
        self.requests = requests
        self.security = security
        self.metrics = metrics
        self.gate = gate if gate is not None else EngineGate(calls)
        self.sink_channels = SinkChannels(requests.max_message_bytes, credentials=sink_credentials,
                                          push_bound_s=requests.sink_timeout_s)
        self.sink_allowlist = requests.sink_allowlist
        self.regions = RegionTable(shared_memory)  # callers' own regions, named in /dev/shm
        self.caller_regions = caller_regions if shared_memory else None  # ... or registered by descriptor
        # Behind relays (--grpc-processes): the regions they lend, by descriptor (api/relay/regions.py).
        self.relay_regions = relay_regions
        # A few threads are enough: each copy runs at memory speed without the GIL.
        self.response_copies = ThreadPoolExecutor(max_workers=4, thread_name_prefix="response-copy")
        # Every open, key check and pwrite of a /dev/shm object a caller names, however small: tmpfs
        # takes the object's inode lock for a pwrite, which its owner can hold for as long as it likes
        # (a write() into it from a buffer whose page fault never completes). On threads of their own,
        # such a caller holds up only other calls naming /dev/shm objects, never the event loop nor the
        # copies of the registered regions and streams.
        self.object_io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="shm-object-io")

    @property
    def engine(self) -> Engine | None:
        """The gate's engine; setting it opens the gate (how a test serves an engine of its own)."""
        return self.gate.engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        self.gate.open(engine)

    async def close(self) -> None:
        """After the ports stopped: closes the sink channels and the response-copy threads."""
        await self.sink_channels.close()
        self.response_copies.shutdown(wait=False)
        self.object_io.shutdown(wait=False)

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext) -> None:
        started = time.perf_counter()
        first_chunk = True
        engine = self.gate.ready()
        plan = parse_encode_request(request, engine, self.requests.max_chunk_bytes, self.sink_allowlist,
                                    self.requests.max_images_per_request)
        request_id = request.request_id or f"{_ID_PREFIX}-{next(_ids)}"
        model_dtype = engine.describe().dtype
        caller = self._caller(context)
        if plan.sink is not None:
            await self._encode_to_sink(engine, plan, request_id, model_dtype, context, caller)
            return
        if request.cache_only:  # encode and cache; each image's header chunk only, no rows
            async with contextlib.aclosing(engine.encode(plan.images, caller)) as results:
                async for result in results:
                    await context.write(region_chunk(result, request_id=request_id, out_dtype=plan.output_dtype,
                                                     model_dtype=model_dtype, offset=0, length=0))
            return
        region = await self._region(request, context)
        # aclosing: a cancelled or failed stream releases its cache pins and queue slots right away.
        async with contextlib.aclosing(engine.encode(plan.images, caller)) as results:
            async for result in results:
                data = result.wire_bytes(plan.output_dtype or model_dtype)  # on the loop: may touch the cache
                chunks = _response_chunks(result, data, request_id, plan, model_dtype, region)
                if isinstance(region, DescriptorWriter):
                    built = built_off_loop(chunks, self.object_io)
                elif len(data) >= OFF_LOOP_MIN_BYTES and not self._alone(engine, plan, model_dtype, region,
                                                                         len(data)):
                    built = built_off_loop(chunks, self.response_copies)
                else:
                    built = _inline(chunks)
                async with contextlib.aclosing(built):
                    async for chunk in built:
                        await context.write(chunk)
                        if first_chunk:
                            first_chunk = False
                            self.metrics.first_chunk_seconds.observe(time.perf_counter() - started)

    def _alone(self, engine: Engine, plan: EncodePlan, model_dtype: str, region: RegionWriter | None,
               nbytes: int) -> bool:
        """Whether an image's response of ``nbytes`` is built right on the event loop (api/streaming.py,
        ALONE_REGION_BYTES): this call the only one in flight on either front end (a cache hit streaming
        beside it is a call too), no image in the engine (being prepared, queued or on a device), one image
        in the request, its rows in the model's dtype (no conversion), and one chunk within its bound:
        into a registered region (not on a host with swap, where a caller can have the region's pages
        written out, for the copy to read back) or on the stream."""
        calls = self.gate.calls
        if (calls.in_flight != 1 or calls.draining or engine.busy or len(plan.images) != 1
                or (plan.output_dtype or model_dtype) != model_dtype):
            return False
        if region is not None and region.fits(nbytes):
            return nbytes <= ALONE_REGION_BYTES and not host_has_swap()
        return nbytes <= min(ALONE_STREAM_BYTES, plan.max_chunk_bytes)

    def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """This call as the engine's fair shares count it: its client (as --max-requests-per-client
        counts them), and the call itself."""
        return Caller(client_of(context.invocation_metadata(), context.peer(),
                                by_token=bool(self.security.auth_token_file), relayed=self.security.relayed))

    async def _region(self, request: encoder_pb2.EncodeRequest,
                      context: grpc.aio.ServicerContext) -> RegionWriter | DescriptorWriter | None:
        """Where this call's rows go instead of the stream: the caller's own region, the region a
        relay lent the call (only behind relays, whose private unix socket is this server's only
        port: a relay drops the key from every caller's metadata), or None."""
        if request.HasField("output_region"):
            region = request.output_region
            if not region.handle:  # opened and checked off the loop (object_io)
                return await asyncio.wrap_future(self.object_io.submit(self.regions.writer, region))
            if region.name or region.key:
                raise InvalidInput("output_region: a handle (a registered region) or a name and key, not both")
            if self.caller_regions is None:
                raise RegionUnusable("output_region.handle: this server takes no registered regions (start it "
                                     "with --shared-memory on); leave output_region unset to get the embeddings "
                                     "on the stream")
            return self.caller_regions.writer(region.handle, region.size)
        if self.relay_regions is None or not context.peer().startswith("unix:"):
            return None
        lend = next((v for k, v in context.invocation_metadata() or () if k == RELAY_REGION), None)
        if lend is None:
            return None
        memory = self.relay_regions.memory(lend)
        if memory is None:  # not registered (cannot happen with our relays): stream instead
            log.warning("a relayed call names a region this server does not know; streaming its response")
            return None
        return RegionWriter(memory)

    async def _encode_to_sink(self, engine: Engine, plan: EncodePlan, request_id: str, model_dtype: str,
                              context: grpc.aio.ServicerContext, caller: Caller) -> None:
        """Each image's chunks go to the sink as it is ready; the caller gets every image's header and
        an OK status only after the sink acknowledged every image. Headers wait for the ack so that
        nothing the caller sees depends on how the sink failed (see api/sink_push.py)."""
        sink, bound = plan.sink, self.requests.sink_timeout_s
        max_chunk_bytes = min(plan.max_chunk_bytes, PUSH_MAX_CHUNK_BYTES)
        push: SinkPush | None = None
        started = 0.0
        headers = []
        channel = self.sink_channels.acquire(sink.target)
        try:
            async with contextlib.aclosing(engine.encode(plan.images, caller)) as results:
                async for result in results:
                    chunks = list(embedding_chunks(result, request_id=sink.request_id,
                                                   out_dtype=plan.output_dtype, model_dtype=model_dtype,
                                                   max_chunk_bytes=max_chunk_bytes))
                    if push is None:  # the bound runs from the first push: encoding is not the sink's time
                        started = time.monotonic()
                        push = SinkPush(sink, channel, len(plan.images), timeout_s=bound)
                    await push.push(chunks)
                    headers.append(header_chunk(chunks[-1], request_id))
            await push.finish()
        except SinkFailed as exc:
            raise await fail_uniformly(sink, exc, started, bound, self.metrics.sink_push_failures) from None
        finally:
            if push is not None:
                push.cancel()
            self.sink_channels.release(sink.target)
        for header in headers:
            await context.write(header)

    async def Lookup(self, request: encoder_pb2.LookupRequest,
                     context: grpc.aio.ServicerContext) -> encoder_pb2.LookupResponse:
        engine = self.gate.ready()
        hashes = request.content_hashes
        if len(hashes) > MAX_LOOKUP_HASHES:
            raise ResourceExhausted(f"lookup of {len(hashes)} hashes; at most {MAX_LOOKUP_HASHES} per call")
        # In slices (turning each into Python strings is most of the cost), the loop free between
        # them. The cache is the loop's alone (no lock), so the slices run on the loop, not in a
        # thread; an entry evicted between two slices is what a Lookup, a hint, may always miss.
        response = encoder_pb2.LookupResponse()
        for start in range(0, len(hashes), LOOKUP_SLICE):
            if start:
                await asyncio.sleep(0)
            response.cached.extend(engine.lookup(hashes[start:start + LOOKUP_SLICE]))
        return response

    async def GetModelInfo(self, request: encoder_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> encoder_pb2.ModelInfo:
        socket_name = self.caller_regions.name if self.caller_regions is not None else ""
        return self.gate.ready().describe(shared_memory=self.regions.enabled, region_socket=socket_name).to_proto()


async def _inline(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def _response_chunks(result: ImageResult, data: memoryview, request_id: str, plan: EncodePlan, model_dtype: str,
                     region: RegionWriter | DescriptorWriter | None) -> Iterator[bytes]:
    """One image's Encode response (``data``: its ``wire_bytes``): one header chunk when its rows
    went into the caller's region, else its rows in chunks on the stream."""
    if region is not None:
        placed = region.place(data) if len(data) else None
        if placed is not None:
            yield region_chunk(result, request_id=request_id, out_dtype=plan.output_dtype,
                               model_dtype=model_dtype, offset=placed[0], length=placed[1])
            return
    yield from serialized_chunks(result, request_id=request_id, out_dtype=plan.output_dtype,
                                 model_dtype=model_dtype, max_chunk_bytes=plan.max_chunk_bytes, data=data)
