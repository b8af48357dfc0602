"""Server life cycle: bind, load and warm the model, serve, drain on SIGTERM, exit.

Health (grpc.health.v1) says NOT_SERVING from the start until the model is loaded and a warm-up
forward ran, SERVING after, NOT_SERVING while no device worker is up and making progress (the
engine's watchdog) and again while draining. Reflection is on, so grpcurl works
without the proto files. With ``--health-port`` a second, plaintext server answers grpc.health.v1
only, from the same HealthServicer (Kubernetes' gRPC probes cannot speak TLS). TLS, tokens and
per-client limits are set up in api/security/settings.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .. import memory
from ..config import ServiceConfig
from ..engine import Engine, warm_memory
from ..fd_limit import raise_open_file_limit
from ..metrics import VISION_ENCODER, ServiceMetrics
from .caller_regions import CallerRegions
from .engine_gate import EngineGate
from .relay.supervisor import RelayProcesses, RelayStartError
from .security.settings import Security, SecurityFileError, build_security
from .service_interceptor import CallBook, ServiceInterceptor
from .servicer import VisionEncoderServicer
from .streaming import serialize_chunk

if TYPE_CHECKING:  # imported when --sglang-compat-port is on (it needs the sglang extra)
    from .sglang.front_end import SglangCompatServer

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.02
DRAIN_QUIET_S = 0.5  # no call began for this long: the backlog is answered, close the port
DRAIN_MAX_QUIET_S = 5.0
MEMORY_CHECK_S = 5.0
TRIM_BUSY_EVERY_S = 15.0
SERVICE_NAME = VISION_ENCODER.full_name
# (client streaming, server streaming) -> the handler factory of that kind
_HANDLER_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler,
                  (False, True): grpc.unary_stream_rpc_method_handler,
                  (True, False): grpc.stream_unary_rpc_method_handler,
                  (True, True): grpc.stream_stream_rpc_method_handler}
# Encode's responses may be wire bytes already (api/streaming.py writes them without copying
# embeddings into messages).
_RESPONSE_SERIALIZERS = {"Encode": serialize_chunk}


def _grpc_options(config: ServiceConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # gRPC turns SO_REUSEPORT on by default: two servers could then share a port unnoticed.
        ("grpc.so_reuseport", 0),
    ]


def _add_vision_encoder(servicer: VisionEncoderServicer, server: grpc.aio.Server) -> None:
    """The generated ``add_VisionEncoderServicer_to_server``, built from the service descriptor,
    except for the response serializers of ``_RESPONSE_SERIALIZERS``."""
    handlers = {}
    for method in VISION_ENCODER.methods:
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        make = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(getattr(servicer, method.name), request_deserializer=request.FromString,
                                     response_serializer=_RESPONSE_SERIALIZERS.get(method.name,
                                                                                   response.SerializeToString))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def _set_health(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, status)


@dataclass
class _Ports:
    """The gRPC ports that drain: the main port and the SGLang port, stopped together with the grace
    the drain left (0 when the start failed or was stopped)."""

    server: grpc.aio.Server
    compat: SglangCompatServer | None = None
    grace_s: float = 0.0

    async def stop(self) -> None:
        await asyncio.gather(self.server.stop(self.grace_s),
                             *([self.compat.stop(self.grace_s)] if self.compat is not None else []))


def _main_server(config: ServiceConfig, metrics: ServiceMetrics, calls: CallBook, security: Security,
                 servicer: VisionEncoderServicer, health_servicer: health.aio.HealthServicer) -> grpc.aio.Server:
    """The main port's server: VisionEncoder, health and reflection behind the interceptors."""
    # First, so that it sees every call to its end, the security interceptors' refusals included.
    interceptors = [ServiceInterceptor(metrics, calls), *security.interceptors]
    server = grpc.aio.server(options=_grpc_options(config), interceptors=interceptors)
    _add_vision_encoder(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server


def _bind(server: grpc.aio.Server, config: ServiceConfig, security: Security,
          relays: RelayProcesses | None) -> int | None:
    """Binds the main port (behind relays: their private unix socket); the port, 0 behind relays,
    None (logged) when it cannot be bound."""
    address = f"{config.host}:{config.port}"
    try:
        if relays is not None:  # the relays own the public port and end TLS (api/relay/supervisor.py)
            server.add_insecure_port(relays.upstream)
            return 0
        return (server.add_secure_port(address, security.tls.credentials) if security.tls
                else server.add_insecure_port(address))
    except RuntimeError as exc:
        log.error("cannot bind %s: %s", relays.upstream if relays else address, exc)
        return None


async def _start_health_port(config: ServiceConfig, health_servicer: health.aio.HealthServicer,
                             resources: contextlib.AsyncExitStack) -> bool:
    """The plaintext health port when --health-port asks for it; False (logged) when it cannot be bound."""
    if config.health_port < 0:
        return True
    health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
    health_address = f"{config.host}:{config.health_port}"
    try:
        health_port = health_server.add_insecure_port(health_address)
    except RuntimeError as exc:
        log.error("cannot bind the health port %s: %s", health_address, exc)
        return False
    await health_server.start()
    # Stopped after the ports that drain: it answers (NOT_SERVING) for as long as they do.
    resources.push_async_callback(health_server.stop, 0)
    log.info("health port (plaintext, grpc.health.v1 only) on %s:%d", config.host, health_port)
    return True


async def _start_sglang_compat(config: ServiceConfig, gate: EngineGate, metrics: ServiceMetrics,
                               calls: CallBook, health_servicer: health.aio.HealthServicer, security: Security):
    """The SGLang-compatible port (api/sglang/front_end.py) when --sglang-compat-port asks for it;
    None when it is off; raises RuntimeError (the message says why) when it cannot start."""
    if config.sglang.port < 0:
        return None
    try:
        from .sglang.front_end import SglangCompatServer
    except ImportError as exc:
        raise RuntimeError(f"--sglang-compat-port needs the sglang extra (pip install "
                           f"'encoder-service[sglang]'): {exc}") from None
    # The front end gets its own group and the two it shares with the main port, not the whole config.
    return await SglangCompatServer.start(config.host, config.sglang, config.requests, config.security, gate, metrics,
                                          calls, health_servicer, _grpc_options(config), security)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


async def _release_free_memory(engine: Engine, calls: CallBook, interval_s: float = MEMORY_CHECK_S,
                               busy_every_s: float = TRIM_BUSY_EVERY_S) -> None:
    """Hands memory the allocator holds but nobody uses back to the kernel: once after each burst
    (no request for a whole interval), and every ``busy_every_s`` under steady load, where freed
    decode buffers would otherwise pile up in the arenas and RSS creep up for minutes. A trim takes
    milliseconds in a thread; allocations wait for it only that long."""
    loop = asyncio.get_running_loop()
    last_seen, trimmed_at, last_trim = -1.0, 0.0, loop.time()
    while True:
        await asyncio.sleep(interval_s)
        seen = calls.last_started  # changes whenever a call began
        idle_after_burst = seen == last_seen and seen != trimmed_at and not engine.busy
        if idle_after_burst or (seen != last_seen and loop.time() - last_trim >= busy_every_s):
            await loop.run_in_executor(None, _trim)
            trimmed_at, last_trim = seen, loop.time()
        last_seen = seen


def _trim() -> None:
    """The warm copies down to the last size (engine/warm_memory.py), then the allocators' free
    memory back to the kernel; in a thread: freeing and trimming take milliseconds."""
    warm_memory.trim()
    memory.release_free_memory()


async def _lame_duck(calls: CallBook, grace_s: float) -> float:
    """Keeps the port open while the calls in flight finish; returns the grace left.

    New calls still reach a handler, which answers UNAVAILABLE at once: clients retry that on
    another replica. ``server.stop()`` instead would cancel the calls gRPC has received but not yet
    handed to a handler (grpc/grpc#41785), and nobody retries CANCELLED: a burst arriving with the
    SIGTERM would be lost. Once the calls that began before the drain are done (calls refused during
    it are not waited for: retrying clients keep sending them), the port stays open until no call
    has begun for DRAIN_QUIET_S, so a backlog of calls gRPC has queued is answered UNAVAILABLE too;
    at most DRAIN_MAX_QUIET_S (clients that keep retrying here would otherwise hold it to the
    grace), never past the grace.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while calls.in_flight > 0 and loop.time() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    give_up = min(deadline, loop.time() + DRAIN_MAX_QUIET_S)
    while loop.time() < give_up and time.monotonic() - calls.last_started < DRAIN_QUIET_S:
        await asyncio.sleep(DRAIN_POLL_S)
    return max(0.0, deadline - loop.time())


async def _load(engine: Engine, stop: asyncio.Event) -> float | None:
    """Loads and warms the model (in workers with --devices); the warm-up seconds, or None when
    SIGTERM came first (nothing in flight to drain). Raises what loading raised."""
    start = asyncio.ensure_future(engine.start())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():
        return None
    stopped.cancel()
    return start.result()


def _log_model(config: ServiceConfig, engine: Engine, warmup_s: float) -> None:
    d = engine.describe()
    # Rows of a model with extra feature levels (deepstack) are that many times hidden wide.
    hidden = f"{d.hidden_size} x {d.feature_levels} levels" if d.feature_levels > 1 else str(d.hidden_size)
    log.info("model %s (%s) on %s, dtype %s, quantization %s, attention backend %s, ops %s, hidden %s, patch_dim %d; "
             "preprocess %s (%d decode threads, decode %s; video: %s); cache %s, max-batch-tokens %d, "
             "batch-wait-ms %g, max-queue-images %d, max-image-pixels %s; responses: shared memory %s for callers "
             "on this host, else streamed; warm-up forward %.0f ms",
             d.model_id, d.model_type, d.device, d.dtype, d.quantization, d.attention_backend, d.ops, hidden,
             d.patch_dim,
             d.preprocess, config.preprocess_threads, d.decode,
             f"{config.video_decode_processes} {config.video_decode} decoder processes" if d.video else "none",
             _gib(config.cache_bytes), config.max_batch_tokens,
             config.batch_wait_ms, config.max_queue_images, engine.pixel_limit_rule(), config.shared_memory,
             warmup_s * 1000)


def _follow_serving(engine: Engine, calls: CallBook, health_servicer: health.aio.HealthServicer) -> None:
    """Health follows the engine from now on: SERVING while some device worker is up and progressing."""
    health_tasks: set[asyncio.Task] = set()

    def on_serving_change(serving: bool) -> None:
        # With worker processes: NOT_SERVING only while no worker is up and progressing (the others
        # keep serving).
        if calls.draining:
            return
        log.warning("%s", "a device worker is up and progressing again: SERVING" if serving
                    else "no device worker is up and progressing: NOT_SERVING")
        task = asyncio.ensure_future(_set_health(health_servicer, serving))
        health_tasks.add(task)
        task.add_done_callback(health_tasks.discard)

    engine.on_serving_change = on_serving_change


async def serve(config: ServiceConfig) -> int:
    """Runs until SIGTERM/SIGINT; returns the process exit code.

    Everything it starts goes on one exit stack, so every exit, a failed start included, lets go of
    it on one path, last started first: the relays (their calls in flight still read from this
    process's socket), the main and SGLang ports (with the grace the drain left), the health port,
    the engine, the servicer's sink channels and threads, the relays' socket directory."""
    memory.limit_arenas()  # before the decode and worker threads exist (see encoder_service/memory.py)
    memory.keep_image_blocks()
    raise_open_file_limit()  # descriptors are held by the request (see encoder_service/fd_limit.py)
    if config.placement.kind == "cuda":  # the model's GPU(s), in this process or in --devices' workers
        # Streamed responses reuse mapped memory (same module). Not where this process or its
        # workers compute on the CPU: there CPU kernels' float32 results depend on where buffers
        # lie, and heap-served buffers lie differently call by call (seen in 1e-6 differences
        # between servers given the same image).
        memory.keep_large_blocks_in_heap()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    metrics = ServiceMetrics(process=True)  # what --metrics-port serves
    calls = CallBook()
    gate = EngineGate(calls)  # the engine, once warm, for both front ends
    async with contextlib.AsyncExitStack() as resources:
        # Each component gets its groups of the config; this function alone holds the whole.
        relays = (RelayProcesses(config.relays, config.requests, config.security) if config.relays.processes > 0
                  else None)
        if relays is not None:
            resources.callback(relays.discard)
        try:
            security = build_security(config.security, relay_regions=relays.regions if relays else None)
        except SecurityFileError as exc:  # reads the --tls-*, --auth-token-file and --sink-tls-* files
            log.error("cannot start: %s", exc)
            return 1
        caller_regions = None
        if config.shared_memory == "on":
            caller_regions = CallerRegions()
            caller_regions.start()
            resources.callback(caller_regions.close)
        servicer = VisionEncoderServicer(config.requests, config.security, metrics, calls,
                                         shared_memory=config.shared_memory == "on", gate=gate,
                                         sink_credentials=security.sink_credentials,
                                         relay_regions=relays.regions if relays else None,
                                         caller_regions=caller_regions)
        resources.push_async_callback(servicer.close)
        engine = Engine(config, metrics=metrics)  # loads nothing until started
        resources.push_async_callback(engine.stop)
        health_servicer = health.aio.HealthServicer()
        server = _main_server(config, metrics, calls, security, servicer, health_servicer)
        await _set_health(health_servicer, False)
        port = _bind(server, config, security, relays)
        if port is None or not await _start_health_port(config, health_servicer, resources):
            return 1
        await server.start()
        ports = _Ports(server)
        resources.push_async_callback(ports.stop)
        if relays is not None:
            resources.push_async_callback(lambda: relays.stop(ports.grace_s))  # first: see the docstring
            try:
                port = await relays.start()
            except RelayStartError as exc:
                log.error("cannot start the gRPC processes: %s", exc)
                return 1
        log.info("encoder-service listening on %s:%d (NOT_SERVING until the model is warm)%s", config.host, port,
                 f"; {relays.count} gRPC processes relay it to this process's {relays.upstream}" if relays else "")
        try:
            ports.compat = await _start_sglang_compat(config, gate, metrics, calls, health_servicer, security)
        except RuntimeError as exc:
            log.error("cannot start the SGLang-compatible port: %s", exc)
            return 1
        log.info("security: %s", "; ".join(security.summary))
        endpoint = config.metrics_endpoint
        if endpoint.port >= 0:
            metrics_port = metrics.serve_http(endpoint.port, endpoint.host)
            log.info("metrics on http://%s:%d/metrics", endpoint.host, metrics_port)

        if config.uses_default_model:
            log.info("no --model given: serving the built-in %s preset (random weights) on %s",
                     config.model_or_default, config.device)
        try:
            warmup_s = await _load(engine, stop)
            if warmup_s is None:
                log.info("stopping before the model finished loading")
                return 0
        except Exception:
            log.exception("could not load and warm up the model %r", config.model_or_default)
            return 1

        _log_model(config, engine, warmup_s)
        gate.open(engine)
        trimmer = asyncio.ensure_future(_release_free_memory(engine, calls))
        await _set_health(health_servicer, engine.serving)
        _follow_serving(engine, calls, health_servicer)
        log.info("SERVING")

        await stop.wait()
        trimmer.cancel()
        log.info("draining: NOT_SERVING, refusing new requests, up to %.1f s for in-flight ones",
                 config.grace_period_s)
        calls.draining = True
        await health_servicer.enter_graceful_shutdown()
        ports.grace_s = await _lame_duck(calls, config.grace_period_s)
    log.info("stopped")
    return 0
