"""Prometheus metrics of the service, defined in one place so operations work can extend them.

Recording is a lock-protected add in process memory: it never blocks the event loop for long and
never touches a device tensor (no GPU sync). The /metrics endpoint is served from its own thread.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

# Buckets fine enough for milliseconds (TEI style) up to a long batch on a busy GPU.
_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)

FORWARD_BATCHES = Counter(
    "encoder_service_forward_batches", "Forward passes of the vision tower (one per batch, warm-up excluded).")
IMAGES = Counter(
    "encoder_service_images", "Images received in requests, by input kind.", ["source"])
IMAGES_ENCODED = Counter(
    "encoder_service_images_encoded", "Images that went through a forward pass.")
PATCHES_ENCODED = Counter(
    "encoder_service_patches_encoded", "Patches that went through a forward pass.")
CACHE_HITS = Counter(
    "encoder_service_cache_hits", "Images served from the embedding cache.")
INFLIGHT_JOINS = Counter(
    "encoder_service_inflight_joins", "Images that joined a forward already under way for the same content.")
CACHE_MISSES = Counter(
    "encoder_service_cache_misses", "Images that needed a new forward pass.")
CACHE_EVICTIONS = Counter(
    "encoder_service_cache_evictions", "Cache entries evicted to make room (LRU by bytes).")
QUEUE_IMAGES = Gauge(
    "encoder_service_queue_images", "Images admitted and waiting for a forward pass (bounded by --max-queue-images).")
REJECTED = Counter(
    "encoder_service_rejected_requests", "Requests answered with an error, by gRPC status.", ["code"])

QUEUE_SECONDS = Histogram(
    "encoder_service_queue_seconds", "Time an image waited between admission and its forward.",
    buckets=_LATENCY_BUCKETS_S)
PREPROCESS_SECONDS = Histogram(
    "encoder_service_preprocess_seconds", "Decode + patchify time of one encoded image.",
    buckets=_LATENCY_BUCKETS_S)
FORWARD_SECONDS = Histogram(
    "encoder_service_forward_seconds", "Wall time of one forward pass, including the copy to the CPU.",
    buckets=_LATENCY_BUCKETS_S)


def start_metrics_server(port: int, host: str) -> int:
    """Starts the /metrics endpoint in a daemon thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_port)
