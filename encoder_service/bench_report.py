"""What the service benchmark reports beyond its own timings: the server's forward counters from
its /metrics around each level, and the summary lines it prints."""

from __future__ import annotations


def forward_totals(args) -> dict[str, float] | None:
    """The server's forward counters (summed over devices) from its /metrics, or None without it."""
    port = getattr(args, "metrics_port", None)
    if port is None:
        return None
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"encoder_service_forward_seconds_sum": "seconds", "encoder_service_forward_seconds_count": "batches",
              "encoder_service_batch_images_sum": "images"}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                totals[wanted[sample.name]] += sample.value
    return totals


def forward_under_load(before: dict | None, after: dict | None) -> dict:
    """The device's forward time per image and the batch size while a level ran: the (b) figure
    beside forward-only's repeated identical batches (a). Counts the clients' warm-up calls too."""
    if not before or not after or after["images"] <= before["images"]:
        return {}
    images = after["images"] - before["images"]
    return {"server_forward_ms_per_image": 1000 * (after["seconds"] - before["seconds"]) / images,
            "server_images_per_batch": images / max(after["batches"] - before["batches"], 1)}


def summary(r: dict) -> str:
    lines = [f"{r['label'] or 'service'}: {r['model']} {r['device']} {r['dtype']} {' '.join(r['serve_args'])}"]
    if "forward_only" in r:
        lines.append(f"  forward only: {r['forward_only']['images_per_s']:.1f} img/s "
                     f"({r['forward_only']['batch_ms']:.1f} ms per 8 x 1008^2)")
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
            alone = (f"; forward-only {r['forward_only']['batch_ms'] / 8:.1f} ms an image in repeated batches of 8"
                     if "forward_only" in r else "")
            lines.append(f"        forward under this load: {x['server_forward_ms_per_image']:.1f} ms an image in "
                         f"batches of {x['server_images_per_batch']:.1f}{alone}")
    hits = r.get("cache_hits") or []
    for h in [hits] if isinstance(hits, dict) else hits:  # one dict in results from before transports
        lines.append(f"  cache hit {h.get('transport', 'stream'):>13} ({h['embedding_bytes'] / 1e6:.1f} MB): p50 "
                     f"{h['latency_p50_ms']:.1f} ms p99 {h['latency_p99_ms']:.1f} ms; 32 clients "
                     f"{h['throughput_32_clients_per_s']:.0f}/s")
    return "\n".join(lines)
