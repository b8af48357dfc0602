"""Prometheus metrics of the service, defined in one place (names: deploy/, README "Operations").

Conventions: one prefix ``encoder_service_``, base units (seconds, bytes), counters end in
``_total`` (prometheus-client appends it to a Counter's name). Recording is a lock-protected add in
process memory: it never blocks the event loop for long and never touches a device tensor (no GPU
sync). The /metrics endpoint is served from its own thread; values that live elsewhere (cache size,
GPU memory) are read at scrape time, on that thread.

Label sets that dashboards and alerts divide by (method x status code, source x model) are created
at zero up front, so a ratio has data before the first error and a panel never shows "no data".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import grpc
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Info, disable_created_metrics, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from . import __version__

log = logging.getLogger(__name__)

PREFIX = "encoder_service_"

# The *_created series double every counter and histogram for a timestamp nobody graphs.
disable_created_metrics()

# Milliseconds-fine at the bottom (TEI style), up to a long request on a busy GPU. 1.0 is a bucket
# boundary on purpose: the latency SLO in deploy/prometheus/alerts.yaml is "Encode under 1 s".
LATENCY_BUCKETS_S = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_TOKEN_BUCKETS = tuple(float(2**k) for k in range(4, 18))  # 16 .. 131072 patches
BATCH_IMAGE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)

RPC_METHODS = ("Encode", "Lookup", "GetModelInfo")
IMAGE_SOURCES = ("encoded", "patches", "content_hash")
STATUS_CODES = tuple(code.name for code in grpc.StatusCode)

# --- requests (api/) --------------------------------------------------------------------------------
REQUESTS = Counter(
    "encoder_service_requests", "gRPC requests finished, by method and status code (OK included).",
    ["method", "code"])
REQUEST_SECONDS = Histogram(
    "encoder_service_request_seconds", "End-to-end time of a request, from the handler's start to "
    "its last message or error, by method.", ["method"], buckets=LATENCY_BUCKETS_S)
FIRST_CHUNK_SECONDS = Histogram(
    "encoder_service_time_to_first_chunk_seconds",
    "Time from an Encode request's start to its first streamed EmbeddingChunk.", buckets=LATENCY_BUCKETS_S)
REQUESTS_IN_FLIGHT = Gauge(
    "encoder_service_requests_in_flight", "gRPC requests being handled right now.")
SINK_PUSH_FAILURES = Counter(
    "encoder_service_sink_push_failures", "Requests whose embeddings could not be pushed to an EmbeddingSink, "
    "by the --allowed-sinks pattern that admitted the target (callers choose targets, not series) and "
    "reason: unavailable, deadline, refused (another status) or bad_ack.", ["pattern", "reason"])

# --- images and the device (engine/) -----------------------------------------------------------------
IMAGES = Counter(
    "encoder_service_images", "Images received in requests, by input kind and served model.",
    ["source", "model"])
FORWARD_BATCHES = Counter(
    "encoder_service_forward_batches", "Forward passes of the vision tower (one per batch, warm-up excluded), "
    "by device.", ["device"])
IMAGES_ENCODED = Counter(
    "encoder_service_images_encoded", "Images that went through a forward pass, by device.", ["device"])
PATCHES_ENCODED = Counter(
    "encoder_service_patches_encoded", "Patches (ViT input tokens) that went through a forward pass.")
TOKENS_ENCODED = Counter(
    "encoder_service_tokens_encoded", "Embedding tokens produced by forward passes (rows of the "
    "[num_tokens, hidden] outputs, i.e. LLM input tokens).")
INFLIGHT_JOINS = Counter(
    "encoder_service_inflight_joins", "Images that joined a forward already under way for the same content.")
QUEUE_IMAGES = Gauge(
    "encoder_service_queue_images", "Images admitted and waiting for a forward pass (bounded by --max-queue-images).")
QUEUE_CAPACITY_IMAGES = Gauge(
    "encoder_service_queue_capacity_images", "--max-queue-images: beyond it a request is RESOURCE_EXHAUSTED.")

QUEUE_SECONDS = Histogram(
    "encoder_service_queue_seconds", "Time an image waited between admission and its forward.",
    buckets=LATENCY_BUCKETS_S)
PREPROCESS_SECONDS = Histogram(
    "encoder_service_preprocess_seconds", "Decode + patchify time of one encoded image.",
    buckets=LATENCY_BUCKETS_S)
FORWARD_SECONDS = Histogram(
    "encoder_service_forward_seconds", "Time of one forward pass on its device (preprocessing on the device "
    "and the copy to the CPU included), by device.", ["device"], buckets=LATENCY_BUCKETS_S)
BATCH_TOKENS = Histogram(
    "encoder_service_batch_tokens", "Patches (ViT input tokens, what --max-batch-tokens bounds) per forward "
    "pass, by device.", ["device"], buckets=BATCH_TOKEN_BUCKETS)
BATCH_IMAGES = Histogram(
    "encoder_service_batch_images", "Images per forward pass, by device.", ["device"], buckets=BATCH_IMAGE_BUCKETS)
WORKERS_UP = Gauge(
    "encoder_service_workers_up", "1 while the device's worker is loaded and serving, 0 while it is down or "
    "restarting, by device. The node serves while any is 1.", ["device"])
WORKER_RESTARTS = Counter(
    "encoder_service_worker_restarts", "Device worker processes that died (killed, CUDA error, out of memory) "
    "and were started again, by device.", ["device"])

# --- the embedding cache (engine/cache.py) ------------------------------------------------------------
CACHE_HITS = Counter(
    "encoder_service_cache_hits", "Images served from the embedding cache.")
CACHE_MISSES = Counter(
    "encoder_service_cache_misses", "Images that needed a new forward pass.")
CACHE_EVICTIONS = Counter(
    "encoder_service_cache_evictions", "Cache entries evicted to make room (LRU by bytes).")
CACHE_ENTRIES = Gauge(
    "encoder_service_cache_entries", "Embeddings held by the cache (read at scrape time).")
CACHE_BYTES = Gauge(
    "encoder_service_cache_bytes", "Bytes of embeddings held by the cache (read at scrape time).")
CACHE_CAPACITY_BYTES = Gauge(
    "encoder_service_cache_capacity_bytes", "--cache-bytes: the cache evicts beyond it.")

MODEL_INFO = Info(
    "encoder_service_model", "The served model: service version, model id and type, attention backend, "
    "device, dtype. Always 1.")


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


GPU_MEMORY = GpuMemoryCollector()
REGISTRY.register(GPU_MEMORY)


def _initialise_request_series(methods: Sequence[str] = RPC_METHODS) -> None:
    for method in methods:
        REQUEST_SECONDS.labels(method=method)
        for code in STATUS_CODES:
            REQUESTS.labels(method=method, code=code)


_initialise_request_series()


def track_engine(*, model_id: str, model_type: str, attn_backend: str, device: str, dtype: str,
                 cache: object, cache_capacity_bytes: int, queue_capacity_images: int,
                 device_memory: dict[str, Callable[[], tuple[int, int]]]) -> None:
    """Points the scrape-time metrics at a started engine and publishes the model's facts.

    ``cache`` needs ``__len__`` and ``used_bytes``; reading them from the scrape thread is safe
    (an int read in CPython), and costs the event loop nothing.
    """
    MODEL_INFO.info({"version": __version__, "model": model_id, "model_type": model_type,
                     "backend": attn_backend, "device": str(device), "dtype": dtype})
    GPU_MEMORY.sources = dict(device_memory)
    for name in device_memory:  # each device's series exist at zero before its first forward
        FORWARD_BATCHES.labels(device=name)
        IMAGES_ENCODED.labels(device=name)
        FORWARD_SECONDS.labels(device=name)
        BATCH_TOKENS.labels(device=name)
        BATCH_IMAGES.labels(device=name)
        WORKER_RESTARTS.labels(device=name)
    CACHE_ENTRIES.set_function(lambda: len(cache))
    CACHE_BYTES.set_function(lambda: cache.used_bytes)
    CACHE_CAPACITY_BYTES.set(cache_capacity_bytes)
    QUEUE_CAPACITY_IMAGES.set(queue_capacity_images)
    for source in IMAGE_SOURCES:
        IMAGES.labels(source=source, model=model_id)


def start_metrics_server(port: int, host: str) -> int:
    """Starts the /metrics endpoint in a daemon thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_port)
