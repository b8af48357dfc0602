"""What the service benchmark reports beyond its own timings: the server's forward counters from
its /metrics around each level, and the summary lines it prints."""

from __future__ import annotations

import itertools


def forward_totals(args) -> dict[str, float] | None:
    """The server's forward counters (summed over devices) and its process's CPU seconds (the
    front end's own: worker processes are others), from its /metrics, or None without /metrics."""
    port = getattr(args, "metrics_port", None)
    if port is None:
        return None
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"encoder_service_forward_seconds_sum": "seconds", "encoder_service_forward_seconds_count": "batches",
              "encoder_service_batch_images_sum": "images",
              "encoder_service_device_preprocess_seconds_sum": "device_preprocess_seconds",
              "process_cpu_seconds_total": "cpu_seconds"}  # prometheus_client's process collector (Linux)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals = dict.fromkeys(wanted.values(), 0.0)
    seen = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                totals[wanted[sample.name]] += sample.value
                seen.add(wanted[sample.name])
    if "cpu_seconds" not in seen:  # no process collector on this platform: no CPU figure, not 0
        del totals["cpu_seconds"]
    return totals


def forward_under_load(before: dict | None, after: dict | None) -> dict:
    """The device's time per image and the batch size while a level ran: the (b) figure beside
    forward-only's repeated identical batches (a), with the device's preprocessing apart (forward-only
    starts from patches already on the device); and the server process's CPU time per image (every
    thread: event loop, decode, hashing, transport), from counters sampled at the start and the end
    of the measured window."""
    if not before or not after or after["images"] <= before["images"]:
        return {}
    images = after["images"] - before["images"]
    seconds = after["seconds"] - before["seconds"]
    preprocess = after["device_preprocess_seconds"] - before["device_preprocess_seconds"]
    out = {"server_forward_ms_per_image": 1000 * seconds / images,
           "server_images_per_batch": images / max(after["batches"] - before["batches"], 1)}
    if preprocess > 0:
        out["server_device_preprocess_ms_per_image"] = 1000 * preprocess / images
        out["server_forward_without_preprocess_ms_per_image"] = 1000 * (seconds - preprocess) / images
    if "cpu_seconds" in before and "cpu_seconds" in after:
        out["server_cpu_ms_per_image"] = 1000 * (after["cpu_seconds"] - before["cpu_seconds"]) / images
    if after.get("children_cpu_seconds", 0) > before.get("children_cpu_seconds", 0):
        # Relay processes (--grpc-processes) or device workers (--devices): the server's children.
        out["server_children_cpu_ms_per_image"] = (
            1000 * (after["children_cpu_seconds"] - before["children_cpu_seconds"]) / images)
    return out


def forward_only_ms_per_image(forward_only: dict, batch: float) -> float | None:
    """Forward-only's ms per image at ``batch`` images, interpolated linearly between the measured
    batch sizes (clamped to the smallest and largest)."""
    by = sorted((int(b), r["ms_per_image"]) for b, r in forward_only.get("by_batch", {}).items())
    if not by:
        return None
    if batch <= by[0][0]:
        return by[0][1]
    for (b0, m0), (b1, m1) in itertools.pairwise(by):
        if batch <= b1:
            return m0 + (m1 - m0) * (batch - b0) / (b1 - b0)
    return by[-1][1]


def summary(r: dict) -> str:
    lines = [f"{r['label'] or 'service'}: {r['model']} {r['device']} {r['dtype']} {' '.join(r['serve_args'])}"]
    if "forward_only" in r:
        fo = r["forward_only"]
        sizes = "".join(f"; batch {b}: {v['ms_per_image']:.1f} ms an image" for b, v in fo.get("by_batch", {}).items())
        lines.append(f"  forward only: {fo['images_per_s']:.1f} img/s ({fo['batch_ms']:.1f} ms per "
                     f"{fo.get('batch', 8)} x 1008^2){sizes}")
    for x in r.get("new_images", []):
        if not x.get("images"):
            continue
        lines.append(f"  new c={x['concurrency']:>3} {x.get('transport', 'stream'):>13}: "
                     f"{x['images_per_s']:6.1f} img/s "
                     f"(x{x.get('ratio_to_forward_only', float('nan')):.2f} of forward-only)  "
                     f"p50 {x['latency_p50_ms']:.1f} ms p99 {x['latency_p99_ms']:.1f} ms  server p50: queue "
                     f"{x['server_queue_ms_p50']:.1f} preprocess {x['server_preprocess_ms_p50']:.1f} "
                     f"forward {x['server_forward_ms_p50']:.1f} ms")
        if "server_forward_ms_per_image" in x:
            lines.append("        " + _under_load(x, r.get("forward_only", {})))
    hits = r.get("cache_hits") or []
    for h in [hits] if isinstance(hits, dict) else hits:  # one dict in results from before transports
        lines.append(f"  cache hit {h.get('transport', 'stream'):>13} ({h['embedding_bytes'] / 1e6:.1f} MB): p50 "
                     f"{h['latency_p50_ms']:.1f} ms p99 {h['latency_p99_ms']:.1f} ms; 32 clients "
                     f"{h['throughput_32_clients_per_s']:.0f}/s")
    return "\n".join(lines)


def _under_load(x: dict, forward_only: dict) -> str:
    """The (b) line: the device's time per image under the level's load, beside forward-only's (a)."""
    batch = x["server_images_per_batch"]
    line = f"device under this load: {x['server_forward_ms_per_image']:.1f} ms an image in batches of {batch:.1f}"
    if "server_device_preprocess_ms_per_image" in x:
        line += (f" ({x['server_device_preprocess_ms_per_image']:.1f} preprocessing + "
                 f"{x['server_forward_without_preprocess_ms_per_image']:.1f} forward)")
    alone = forward_only_ms_per_image(forward_only, batch)
    if alone is not None:
        line += f"; forward-only at that batch size {alone:.1f} ms"
    if "server_cpu_ms_per_image" in x:
        line += f"; server CPU {x['server_cpu_ms_per_image']:.1f} ms an image"
    if "server_children_cpu_ms_per_image" in x:
        line += f" (+ {x['server_children_cpu_ms_per_image']:.1f} in its child processes)"
    return line
