"""Two servers' lone-image latency, compared image by image: paired, alternating requests.

    python3 bench/lone_pairs.py --a-cwd .before --b-cwd . [--image-size 448] [--pairs 300] [--gap-s 6]
        [--model qwen2.5-vl-7b --device cuda --dtype bfloat16] [--a-args "..."] [--b-args "..."] [--out F.json]

Why: one GPU machine drifts within a command (the same tree measured 11.4 and then 13.8 ms a lone
448x448 image in one run, bench/RESULTS.md), so two contenders measured one after the other differ
by the drift as much as by their code. Here both servers run at once on the same device (each from
its own checkout, ``--a-cwd``/``--b-cwd``, with its own serve flags), and one client sends every new
JPEG to both, one request at a time, the order alternating pair by pair (A then B, then B then A):
drift reaches both sides of a pair alike. Each server has its own cache, so the same image is new
work for both. Then the same with one image sent again and again (cache hits), unless ``--no-hits``.

Reported per side: p50, p99 and mean; and the median of B - A over the pairs with a 95% bootstrap
interval (negative: B is faster). The interval covers the pairs' scatter, not the spread between two
server processes: the same tree on both sides (``--a-cwd . --b-cwd .``) measured +0.54 ms at 448x448 on
an H200 (bench/RESULTS.md, 2026-12-02), so a difference of that size needs such an A/A run beside
it. A plain ``EncoderClient`` (shared memory on the same host, as users run it), bfloat16 rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "client"))


def paired_difference(a_ms: list[float], b_ms: list[float], *, resamples: int = 2000, seed: int = 0) -> dict:
    """The median of b - a over pairs, with a 95% bootstrap interval of that median."""
    diff = np.asarray(b_ms, dtype=float) - np.asarray(a_ms, dtype=float)
    if not len(diff):
        raise ValueError("no pairs")
    rng = np.random.default_rng(seed)
    medians = np.median(diff[rng.integers(0, len(diff), (resamples, len(diff)))], axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return {"median_ms": float(np.median(diff)), "ci95_ms": [float(low), float(high)],
            "b_faster_in": float(np.mean(diff < 0))}


def _side(values: list[float]) -> dict:
    v = np.asarray(values, dtype=float)
    return {"p50_ms": float(np.percentile(v, 50)), "p99_ms": float(np.percentile(v, 99)), "mean_ms": float(v.mean()),
            "n": len(values)}


def _timed(client, image: bytes) -> float:
    started = time.perf_counter()
    client.encode([image], output_dtype="bfloat16", timeout_s=120)
    return (time.perf_counter() - started) * 1000.0


def run_pairs(clients: dict, images: list[bytes], warmup: int, gap_s: float = 0.0) -> dict:
    """Each image to both servers, the order alternating; the first ``warmup`` pairs not counted;
    ``gap_s`` of quiet before each pair."""
    times = {"a": [], "b": []}
    for i, image in enumerate(images):
        if gap_s:
            time.sleep(gap_s)
        order = ("a", "b") if i % 2 == 0 else ("b", "a")
        got = {side: _timed(clients[side], image) for side in order}
        if i >= warmup:
            for side in ("a", "b"):
                times[side].append(got[side])
    return times


def client_for(target: str, stream: str):
    """A plain EncoderClient; ``stream="threads"``: one whose Encode stream is gRPC's default (a
    channel-spin thread started per call), as clients were before 4427ba4."""
    from encoder_client import EncoderClient

    if stream == "single":
        return EncoderClient(target)

    class ThreadedStreamClient(EncoderClient):
        _surface_options = ()

    return ThreadedStreamClient(target)


def main(argv: list[str] | None = None) -> int:
    from encoder_service.benchmarks.service import start_server, stop_process
    from encoder_service.benchmarks.service_clients import make_images

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-vl-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attn-backend", default="auto")
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10, help="pairs not counted at the start")
    parser.add_argument("--hit-pairs", type=int, default=200)
    parser.add_argument("--no-hits", action="store_true")
    parser.add_argument("--a-cwd", default=".")
    parser.add_argument("--b-cwd", default=".")
    parser.add_argument("--a-args", default="", help="serve flags of server A (one string)")
    parser.add_argument("--b-args", default="", help="serve flags of server B (one string)")
    for side in ("a", "b"):
        parser.add_argument(f"--{side}-client-stream", choices=("single", "threads"), default="single",
                            help=f"client {side.upper()}'s Encode stream: read on the calling thread (the "
                                 "client's default since 4427ba4) or gRPC's default, which starts a channel-spin "
                                 "thread per call (what clients had before)")
    parser.add_argument("--gap-s", type=float, default=0.0,
                        help="seconds of quiet before each pair of new images: over the servers' idle trim (5 s), "
                             "each image is a lone request after an idle spell, as in a lightly loaded fleet")
    parser.add_argument("--start-timeout-s", type=float, default=900.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    images = make_images(args.pairs + args.warmup, 10_000, 4, args.image_size)
    servers, clients = {}, {}
    out_dir = args.out.parent if args.out else Path.cwd()
    try:
        for side in ("a", "b"):
            spec = SimpleNamespace(model=args.model, device=args.device, dtype=args.dtype,
                                   attn_backend=args.attn_backend, server_cwd=getattr(args, f"{side}_cwd"),
                                   serve_args=shlex.split(getattr(args, f"{side}_args")),
                                   start_timeout_s=args.start_timeout_s)
            servers[side] = start_server(spec, out_dir / f"lone-pairs-{side}.server.log")
            clients[side] = client_for(servers[side][1], getattr(args, f"{side}_client_stream"))
        new = run_pairs(clients, images, args.warmup, args.gap_s)
        result = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "command": " ".join(sys.argv),
                  "model": args.model, "device": args.device, "dtype": args.dtype, "image_size": args.image_size,
                  "gap_s": args.gap_s,
                  "jpeg_bytes_mean": float(np.mean([len(i) for i in images])),
                  "a": {"cwd": args.a_cwd, "args": args.a_args, "client_stream": args.a_client_stream},
                  "b": {"cwd": args.b_cwd, "args": args.b_args, "client_stream": args.b_client_stream},
                  "new_images": {"a": _side(new["a"]), "b": _side(new["b"]),
                                 "b_minus_a": paired_difference(new["a"], new["b"])}}
        fresh = result["new_images"]
        print(f"new {args.image_size}x{args.image_size} JPEGs, {len(new['a'])} pairs"
              f"{f' each after {args.gap_s:g} s of quiet' if args.gap_s else ''}: "
              f"A p50 {fresh['a']['p50_ms']:.2f} ms, B p50 {fresh['b']['p50_ms']:.2f} ms; "
              f"B - A median {fresh['b_minus_a']['median_ms']:+.2f} ms "
              f"(95% {fresh['b_minus_a']['ci95_ms'][0]:+.2f} .. {fresh['b_minus_a']['ci95_ms'][1]:+.2f})")
        if not args.no_hits:
            hits = run_pairs(clients, [images[0]] * (args.hit_pairs + args.warmup), args.warmup)
            result["cache_hits"] = {"a": _side(hits["a"]), "b": _side(hits["b"]),
                                    "b_minus_a": paired_difference(hits["a"], hits["b"])}
            diff = result["cache_hits"]["b_minus_a"]
            print(f"cache hits, {len(hits['a'])} pairs: A p50 {result['cache_hits']['a']['p50_ms']:.2f} ms, "
                  f"B p50 {result['cache_hits']['b']['p50_ms']:.2f} ms; B - A median {diff['median_ms']:+.2f} ms "
                  f"(95% {diff['ci95_ms'][0]:+.2f} .. {diff['ci95_ms'][1]:+.2f})")
    finally:
        for client in clients.values():
            client.close()
        for proc, _ in servers.values():
            stop_process(proc)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
