"""Writes deploy/grafana/encoder-service.json, the Grafana dashboard of encoder-service.

    python deploy/grafana/generate_dashboard.py

The JSON is generated so that every panel follows one pattern and its queries are easy to read
here; tests/deploy/test_deploy_dashboard.py fails when the JSON is stale, and tests/deploy/test_deploy_prometheus.py
runs every query against a real Prometheus scraping a real server.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("encoder-service.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'instance=~"$instance"'
RATE = "$__rate_interval"
NOT_OK = 'code!="OK"'


def _sel(extra: str = "") -> str:
    return "{" + ", ".join(s for s in (extra, SEL) if s) + "}"


def rate(metric: str, extra: str = "") -> str:
    return f"rate({metric}{_sel(extra)}[{RATE}])"


def quantiles(metric: str, extra: str = "") -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) ({rate(metric + '_bucket', extra)}))", f"p{round(q * 100)}")
            for q in (0.5, 0.95, 0.99)]


# (title, unit, kind, [(expr, legend)], description)
ROWS: list[tuple[str, list[tuple[str, str, str, list[tuple[str, str]], str]]]] = [
    ("Throughput", [
        ("Images / s", "ops", "timeseries", [
            (f"sum by (source) ({rate('encoder_service_images_total')})", "received: {{source}}"),
            (f"sum({rate('encoder_service_images_encoded_total')})", "encoded (forward)"),
            (f"sum({rate('encoder_service_cache_hits_total')})", "cache hits"),
            (f"sum({rate('encoder_service_video_frames_decoded_total')})", "video frames decoded"),
        ], "Images (and clips: source video) received by input kind, encoded by a forward pass, served from the "
           "cache; and the frames of clips decoded."),
        ("Tokens / s", "ops", "timeseries", [
            (f"sum({rate('encoder_service_tokens_encoded_total')})", "embedding tokens"),
            (f"sum by (modality) ({rate('encoder_service_modality_tokens_encoded_total')})",
             "embedding tokens: {{modality}}"),
            (f"sum({rate('encoder_service_patches_encoded_total')})", "patches (ViT input)"),
        ], "Embedding tokens produced (LLM input tokens), by modality (images, clips), and the patches that "
           "went into the ViT."),
        ("Requests / s by method and code", "reqps", "timeseries", [
            (f"sum by (method, code) ({rate('encoder_service_requests_total')}) > 0", "{{method}} {{code}}"),
            (f"sum({rate('encoder_service_requests_total')})", "all"),
        ], "Finished gRPC requests."),
        ("Errors / s by code", "reqps", "timeseries", [
            (f"sum by (code) ({rate('encoder_service_requests_total', NOT_OK)})", "{{code}}"),
        ], "Requests that ended with a status other than OK."),
    ]),
    ("Latency", [
        ("Encode end-to-end", "s", "timeseries",
         quantiles("encoder_service_request_seconds", 'method="Encode"'),
         "From the handler's start to the last chunk; the SLO alert counts requests over 1 s."),
        ("Time to first chunk", "s", "timeseries", quantiles("encoder_service_time_to_first_chunk_seconds"),
         "From an Encode request's start to its first streamed chunk (cache hits stream first)."),
        ("Queue wait", "s", "timeseries", quantiles("encoder_service_queue_seconds"),
         "An image's wait between admission and its forward pass."),
        ("Preprocessing", "s", "timeseries", quantiles("encoder_service_preprocess_seconds"),
         "Decode + resize + patchify of one encoded image."),
        ("Video decode", "s", "timeseries", quantiles("encoder_service_video_decode_seconds"),
         "One clip's decode (in a decoder process), frame sampling and processing."),
        ("Forward pass", "s", "timeseries", quantiles("encoder_service_forward_seconds"),
         "One batch through the vision tower, including the copy to the CPU."),
        ("Preprocessing on the device", "s", "timeseries", quantiles("encoder_service_device_preprocess_seconds"),
         "The part of a batch's forward time spent preprocessing on the GPU (decode with --decode nvjpeg, "
         "resize, normalize, patchify)."),
    ]),
    ("Cache", [
        ("Cache hit ratio", "percentunit", "timeseries", [
            (f"sum({rate('encoder_service_cache_hits_total')}) / (sum({rate('encoder_service_cache_hits_total')})"
             f" + sum({rate('encoder_service_cache_misses_total')}))", "hit ratio"),
        ], "Images served from the cache over all images looked up (in-flight joins excluded)."),
        ("Cache bytes", "bytes", "timeseries", [
            (f"sum by (instance) (encoder_service_cache_bytes{_sel()})", "used {{instance}}"),
            (f"sum by (instance) (encoder_service_cache_capacity_bytes{_sel()})", "capacity {{instance}}"),
        ], "Bytes of embeddings held, against --cache-bytes."),
        ("Cache entries and evictions", "short", "timeseries", [
            (f"sum by (instance) (encoder_service_cache_entries{_sel()})", "entries {{instance}}"),
            (f"sum by (instance) ({rate('encoder_service_cache_evictions_total')})", "evictions/s {{instance}}"),
        ], "Entries held and LRU evictions per second."),
    ]),
    ("Load and device", [
        ("Queue depth", "short", "timeseries", [
            (f"sum by (instance) (encoder_service_queue_images{_sel()})", "queued images {{instance}}"),
            (f"sum by (instance) (encoder_service_queue_capacity_images{_sel()})", "capacity {{instance}}"),
            (f"sum by (instance) (encoder_service_requests_in_flight{_sel()})", "requests in flight {{instance}}"),
        ], "Images waiting for a forward pass (RESOURCE_EXHAUSTED beyond the capacity) and requests being handled."),
        ("Batch size", "short", "timeseries", [
            (f"sum({rate('encoder_service_batch_images_sum')}) / sum({rate('encoder_service_batch_images_count')})",
             "images / batch (mean)"),
            (f"sum({rate('encoder_service_batch_tokens_sum')}) / sum({rate('encoder_service_batch_tokens_count')})",
             "patches / batch (mean)"),
            (f"histogram_quantile(0.95, sum by (le) ({rate('encoder_service_batch_tokens_bucket')}))",
             "patches / batch (p95)"),
        ], "How full forward passes are; --max-batch-tokens bounds the patches."),
        ("GPU memory", "bytes", "timeseries", [
            (f"sum by (instance, device) (encoder_service_gpu_memory_allocated_bytes{_sel()})",
             "allocated {{instance}} {{device}}"),
            (f"sum by (instance, device) (encoder_service_gpu_memory_reserved_bytes{_sel()})",
             "reserved {{instance}} {{device}}"),
        ], "torch's caching allocator on the model's device (0 on a CPU model)."),
        ("Device workers", "short", "timeseries", [
            (f"sum by (instance, device) (encoder_service_workers_up{_sel()})", "up {{instance}} {{device}}"),
            (f"sum by (instance, device) (encoder_service_worker_stalled{_sel()})", "stalled {{instance}} {{device}}"),
        ], "1 while the device's worker is up; stalled: it had work and completed no forward for longer than "
           "--watchdog-timeout-s, or its thread died (alert EncoderServiceWorkerStalled)."),
        ("Sink push failures / s", "ops", "timeseries", [
            # No series exists before the first failure: show 0.
            (f"sum by (pattern, reason) ({rate('encoder_service_sink_push_failures_total')}) or on() vector(0)",
             "{{pattern}} {{reason}}"),
        ], "Requests whose embeddings could not be pushed to an EmbeddingSink, by --allowed-sinks pattern "
           "and reason."),
        ("Instances", "short", "table", [
            (f"encoder_service_model_info{_sel()}", ""),
        ], "Version, model, attention backend, device and dtype of each instance."),
        ("Up", "short", "stat", [
            (f'up{{job="encoder-service", {SEL}}}', "{{instance}}"),
        ], "1 while Prometheus can scrape the instance."),
    ]),
]


def build() -> dict:
    panels: list[dict] = []
    panel_id = 1
    y = 0
    for row_title, row_panels in ROWS:
        panels.append({"type": "row", "title": row_title, "id": panel_id, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id += 1
        y += 1
        for i, (title, unit, kind, queries, description) in enumerate(row_panels):
            panel = {
                "type": kind, "title": title, "id": panel_id, "datasource": DATASOURCE,
                "description": description,
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {},
                "targets": [{"refId": chr(ord("A") + k), "datasource": DATASOURCE, "expr": expr,
                             "legendFormat": legend, "range": kind != "table", "instant": kind == "table",
                             **({"format": "table"} if kind == "table" else {})}
                            for k, (expr, legend) in enumerate(queries)],
            }
            if kind == "timeseries":
                panel["options"] = {"legend": {"displayMode": "list", "placement": "bottom"},
                                    "tooltip": {"mode": "multi"}}
            panels.append(panel)
            panel_id += 1
        y += 8 * ((len(row_panels) + 2) // 3)
    return {
        "title": "encoder-service",
        "uid": "encoder-service",
        "description": "Vision-encoder microservice (EPD): throughput, latency by stage, cache, queue, "
                       "batches, errors, GPU memory.",
        "tags": ["encoder-service", "epd", "grpc"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            {"type": "query", "name": "instance", "label": "Instance", "datasource": DATASOURCE,
             "query": {"query": "label_values(encoder_service_model_info, instance)", "refId": "instance"},
             "definition": "label_values(encoder_service_model_info, instance)",
             "includeAll": True, "multi": True, "allValue": ".+", "current": {}, "refresh": 2, "sort": 1,
             "hide": 0},
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
