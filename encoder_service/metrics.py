"""Prometheus metrics of the service, defined in one place (names: deploy/, README "Operations").

``ServiceMetrics(registry)`` declares every metric on the ``CollectorRegistry`` it is given: the
server builds one and serves it on ``--metrics-port``; the engine and the API record into the
object they are handed; a test builds its own and reads it with ``registry.get_sample_value``.
Nothing is global, so several engines or servers in one process never share counts.

Conventions: one prefix ``encoder_service_``, base units (seconds, bytes), counters end in
``_total`` (prometheus-client appends it to a Counter's name). Recording is a lock-protected add in
process memory: it never blocks the event loop for long and never touches a device tensor (no GPU
sync). The /metrics endpoint is served from its own thread; values that live elsewhere (cache size,
GPU memory) are read at scrape time, on that thread.

Label sets that dashboards and alerts divide by (method x status code, source x model) are created
at zero up front, so a ratio has data before the first error and a panel never shows "no data".

The ``model`` labels name the model (``model_label``: a preset's name, a checkpoint directory's last
component), never its path on the server's disk: /metrics has no TLS and no token.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import PurePosixPath

from encoder_client.protocol import encoder_pb2
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from . import __version__
from .errors import STATUS_CODES
from .modality import MODALITIES, Modality

log = logging.getLogger(__name__)

PREFIX = "encoder_service_"

# The *_created series double every counter and histogram for a timestamp nobody graphs.
disable_created_metrics()

# Milliseconds-fine at the bottom (TEI style), up to a long request on a busy GPU. 1.0 is a bucket
# boundary on purpose: the latency SLO in deploy/prometheus/alerts.yaml is "Encode under 1 s".
LATENCY_BUCKETS_S = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_TOKEN_BUCKETS = tuple(float(2**k) for k in range(4, 18))  # 16 .. 131072 patches
# The stages of a clip's CPU half (engine/video_preparation.py), in order: waiting for a decoder (a slot,
# shared fairly between callers), the decode in its process (probe, sample, decode, the frames handed
# back), and the frames made ready for the device (the family's resize step; in pil mode the resize).
VIDEO_STAGES = ("decoder_wait", "decode", "frames")
BATCH_IMAGE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)

# The served gRPC service, from the generated descriptor: its methods are the ``method`` label's
# values (a method added to the proto gets its series without a list kept by hand).
VISION_ENCODER = encoder_pb2.DESCRIPTOR.services_by_name["VisionEncoder"]
RPC_METHODS = tuple(m.name for m in VISION_ENCODER.methods)
IMAGE_SOURCES = ("encoded", "patches", "content_hash", "video")


_HF_CACHE_DIR = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)")


def model_label(model_id: str) -> str:
    """How metrics name the served model: a preset id as is (``tiny-qwen2.5-vl@seed0``), a
    checkpoint directory by its last component (``/models/Qwen2.5-VL-7B-Instruct`` ->
    ``Qwen2.5-VL-7B-Instruct``; a Hugging Face cache snapshot by its repository, ``Qwen/...``),
    never the path: where the operator keeps its models is not for whoever can reach /metrics."""
    path = PurePosixPath(model_id)
    parts = path.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and (m := _HF_CACHE_DIR.fullmatch(parts[-3])):
        return f"{m['org']}/{m['name']}"
    return path.name or model_id


class GpuMemoryCollector(Collector):
    """Device memory (``torch.cuda.memory_allocated`` / ``memory_reserved``) of each device, read at
    scrape time from the engine's sources: the caching allocator's host-side counters in-process,
    the figures each worker process last reported otherwise. No kernel, no device sync; a CPU
    device exports 0, so dashboard queries return data everywhere. Nothing before the model loads.
    """

    def __init__(self) -> None:
        self.sources: dict[str, Callable[[], tuple[int, int]]] = {}

    def collect(self) -> Iterable[GaugeMetricFamily]:
        allocated = GaugeMetricFamily(PREFIX + "gpu_memory_allocated_bytes",
                                      "Device memory held by tensors (torch.cuda.memory_allocated); 0 on a CPU model.",
                                      labels=["device"])
        reserved = GaugeMetricFamily(PREFIX + "gpu_memory_reserved_bytes",
                                     "Device memory reserved by torch's caching allocator "
                                     "(torch.cuda.memory_reserved); 0 on a CPU model.", labels=["device"])
        for name, read in list(self.sources.items()):
            used, held = read()
            allocated.add_metric([name], float(used))
            reserved.add_metric([name], float(held))
        yield allocated
        yield reserved


class ServiceMetrics:
    """Every metric of one server (or one test's engine), on ``registry``.

    ``process=True`` adds prometheus-client's ``process_*`` and ``python_*`` series (the server's
    registry; a test's needs none).
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = False) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        if process:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)

        # --- requests (api/) ----------------------------------------------------------------------
        self.requests = Counter(
            "encoder_service_requests", "gRPC requests finished, by method and status code (OK included).",
            ["method", "code"], registry=r)
        self.request_seconds = Histogram(
            "encoder_service_request_seconds", "End-to-end time of a request, from the handler's start to "
            "its last message or error, by method.", ["method"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.first_chunk_seconds = Histogram(
            "encoder_service_time_to_first_chunk_seconds",
            "Time from an Encode request's start to its first streamed EmbeddingChunk.", buckets=LATENCY_BUCKETS_S,
            registry=r)
        self.requests_in_flight = Gauge(
            "encoder_service_requests_in_flight", "gRPC requests being handled right now.", registry=r)
        self.sink_push_failures = Counter(
            "encoder_service_sink_push_failures", "Requests whose embeddings could not be pushed to an "
            "EmbeddingSink, by the --allowed-sinks pattern that admitted the target (callers choose targets, "
            "not series) and reason: unavailable, deadline, refused (another status) or bad_ack.",
            ["pattern", "reason"], registry=r)

        # --- images and the device (engine/) -----------------------------------------------------
        self.images = Counter(
            "encoder_service_images", "Items received in requests (images, and clips: source=\"video\"), by "
            "input kind and served model.",
            ["source", "model"], registry=r)
        self.forward_batches = Counter(
            "encoder_service_forward_batches", "Forward passes of the vision tower (one per batch, warm-up "
            "excluded), by device.", ["device"], registry=r)
        self.images_encoded = Counter(
            "encoder_service_images_encoded", "Items that went through a forward pass (images, clips and parts of "
            "clips, each one), by device.", ["device"],
            registry=r)
        self.patches_encoded = Counter(
            "encoder_service_patches_encoded", "Patches (ViT input tokens) that went through a forward pass.",
            registry=r)
        self.tokens_encoded = Counter(
            "encoder_service_tokens_encoded", "Embedding tokens produced by forward passes (rows of the "
            "[num_tokens, hidden] outputs, i.e. LLM input tokens).", registry=r)
        self.modality_tokens_encoded = Counter(
            "encoder_service_modality_tokens_encoded", "Embedding tokens produced by forward passes, by "
            "modality (image: images and patches; video: clips).", ["modality"], registry=r)
        self.video_frames_decoded = Counter(
            "encoder_service_video_frames_decoded", "Frames of clips decoded (the sampled ones, each once).",
            registry=r)
        self.video_decode_seconds = Histogram(
            "encoder_service_video_decode_seconds", "Decode, sampling and processing time of one clip.",
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.video_stage_seconds = Histogram(
            "encoder_service_video_stage_seconds", "Time one clip spent in each stage of its CPU half: "
            "decoder_wait (for a decoder, shared fairly between callers), decode (in its decoder process, the "
            "frames handed back included, and the process's start where the clip needed a new one), frames "
            "(made ready for the device). Each is recorded when it ends, whether it succeeded or not (a wait "
            "refused or cancelled included).", ["stage"],
            buckets=LATENCY_BUCKETS_S, registry=r)
        for stage in VIDEO_STAGES:  # a panel has series before the first clip
            self.video_stage_seconds.labels(stage=stage)
        self.inflight_joins = Counter(
            "encoder_service_inflight_joins", "Items (images or clips) that joined a forward already under way for "
            "the same content.", registry=r)
        self.images_abandoned = Counter(
            "encoder_service_images_abandoned", "Items (images or clips) dropped before their forward because "
            "every request waiting for them went away (cancelled, deadline, failed): work not done.", registry=r)
        self.queue_images = Gauge(
            "encoder_service_queue_images", "Items admitted and waiting for a forward pass, an image or a clip "
            "each (bounded by --max-queue-images).", registry=r)
        self.queue_capacity_images = Gauge(
            "encoder_service_queue_capacity_images", "--max-queue-images: beyond it a request is "
            "RESOURCE_EXHAUSTED.", registry=r)
        self.queue_seconds = Histogram(
            "encoder_service_queue_seconds", "Time an item (image or clip) waited between admission and its "
            "forward.",
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.preprocess_seconds = Histogram(
            "encoder_service_preprocess_seconds", "Decode + patchify time of one encoded image.",
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.forward_seconds = Histogram(
            "encoder_service_forward_seconds", "Time of one forward pass on its device (preprocessing on the "
            "device and the copy to the CPU included), by device.", ["device"], buckets=LATENCY_BUCKETS_S,
            registry=r)
        self.device_preprocess_seconds = Histogram(
            "encoder_service_device_preprocess_seconds", "The part of encoder_service_forward_seconds spent "
            "preprocessing on the device (JPEG decode with --decode nvjpeg, resize, normalize, patchify) before "
            "the forward, by device; CUDA only.", ["device"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.batch_tokens = Histogram(
            "encoder_service_batch_tokens", "Patches (ViT input tokens, what --max-batch-tokens bounds) per "
            "forward pass, by device.", ["device"], buckets=BATCH_TOKEN_BUCKETS, registry=r)
        self.batch_images = Histogram(
            "encoder_service_batch_images", "Items per forward pass (images, clips or parts of clips), by "
            "device.", ["device"], buckets=BATCH_IMAGE_BUCKETS, registry=r)
        self.workers_up = Gauge(
            "encoder_service_workers_up", "1 while the device's worker is loaded and serving, 0 while it is "
            "down or restarting, by device. The node serves while any is 1.", ["device"], registry=r)
        self.worker_restarts = Counter(
            "encoder_service_worker_restarts", "Device worker processes that died (killed, CUDA error, out of "
            "memory) and were started again, by device.", ["device"], registry=r)
        self.worker_stalled = Gauge(
            "encoder_service_worker_stalled", "1 while the device's worker makes no progress: it had work and "
            "completed no forward for longer than --watchdog-timeout-s, or its thread died. Health is "
            "NOT_SERVING while no device is up and progressing.", ["device"], registry=r)

        # --- the embedding cache (engine/cache.py) ------------------------------------------------
        self.cache_hits = Counter(
            "encoder_service_cache_hits", "Items (images or clips) served from the embedding cache.", registry=r)
        self.cache_misses = Counter(
            "encoder_service_cache_misses", "Items (images or clips) that needed a new forward pass.", registry=r)
        self.cache_evictions = Counter(
            "encoder_service_cache_evictions", "Cache entries evicted to make room (LRU by bytes).", registry=r)
        self.cache_entries = Gauge(
            "encoder_service_cache_entries", "Embeddings held by the cache (read at scrape time).", registry=r)
        self.cache_bytes = Gauge(
            "encoder_service_cache_bytes", "Bytes of embeddings held by the cache (read at scrape time).",
            registry=r)
        self.cache_capacity_bytes = Gauge(
            "encoder_service_cache_capacity_bytes", "--cache-bytes: the cache evicts beyond it.", registry=r)

        self.model_info = Info(
            "encoder_service_model", "The served model: service version, model id and type, attention "
            "backend, device, dtype. Always 1.", registry=r)
        self.gpu_memory = GpuMemoryCollector()
        r.register(self.gpu_memory)
        self._model = ""  # model_label of the served model, once track_engine knows it
        self._initialise_request_series(RPC_METHODS)

    def _initialise_request_series(self, methods: Sequence[str]) -> None:
        for method in methods:
            self.request_seconds.labels(method=method)
            for code in STATUS_CODES:
                self.requests.labels(method=method, code=code)

    def track_engine(self, *, model_id: str, model_type: str, attn_backend: str, device: str, dtype: str,
                     cache: object, cache_capacity_bytes: int, queue_capacity_images: int,
                     device_memory: dict[str, Callable[[], tuple[int, int]]]) -> None:
        """Points the scrape-time metrics at a started engine and publishes the model's facts.

        ``cache`` needs ``__len__`` and ``used_bytes``; reading them from the scrape thread is safe
        (an int read in CPython), and costs the event loop nothing.
        """
        self._model = model = model_label(model_id)
        self.model_info.info({"version": __version__, "model": model, "model_type": model_type,
                              "backend": attn_backend, "device": str(device), "dtype": dtype})
        self.gpu_memory.sources = dict(device_memory)
        for name in device_memory:  # each device's series exist at zero before its first forward
            self.forward_batches.labels(device=name)
            self.images_encoded.labels(device=name)
            self.forward_seconds.labels(device=name)
            self.device_preprocess_seconds.labels(device=name)
            self.batch_tokens.labels(device=name)
            self.batch_images.labels(device=name)
            self.worker_restarts.labels(device=name)
            self.worker_stalled.labels(device=name)
        self.cache_entries.set_function(lambda: len(cache))
        self.cache_bytes.set_function(lambda: cache.used_bytes)
        self.cache_capacity_bytes.set(cache_capacity_bytes)
        self.queue_capacity_images.set(queue_capacity_images)
        for source in IMAGE_SOURCES:
            self.images.labels(source=source, model=model)
        for modality in MODALITIES:
            self.modality_tokens_encoded.labels(modality=modality)

    def image_received(self, source: str) -> None:
        """One image of a request, by its kind (IMAGE_SOURCES), for the served model."""
        self.images.labels(source=source, model=self._model).inc()

    def record_encoded(self, device: str, patches: int, tokens: int, modality: Modality, complete: bool = True) -> None:
        """One image (or clip) out of a forward: its patches in, its embedding tokens out. A part of a clip
        split over forwards counts its patches and tokens; the clip counts as encoded with its last part
        (``complete``)."""
        if complete:
            self.images_encoded.labels(device=device).inc()
        self.patches_encoded.inc(patches)
        self.tokens_encoded.inc(tokens)
        self.modality_tokens_encoded.labels(modality=modality).inc(tokens)

    def record_forward(self, device: str, forward_s: float, images: int, patches: int,
                       preprocess_s: float | None = None) -> None:
        """One batch came back from ``device`` (successful or not: its time and size were spent)."""
        self.forward_batches.labels(device=device).inc()
        self.forward_seconds.labels(device=device).observe(forward_s)
        if preprocess_s is not None:
            self.device_preprocess_seconds.labels(device=device).observe(preprocess_s)
        self.batch_images.labels(device=device).observe(images)
        self.batch_tokens.labels(device=device).observe(patches)

    def serve_http(self, port: int, host: str) -> int:
        """Starts the /metrics endpoint of this registry in a daemon thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)
