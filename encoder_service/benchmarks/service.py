"""The service as users run it: a real server process, client processes, photo-like JPEGs.

    encoder-service bench service --model qwen2.5-vl-7b --device cuda --dtype bfloat16 \
        --out results.json [-- EXTRA SERVE FLAGS]
    (the same as: python -m encoder_service.benchmarks.service ...)

Reports, in one run on one machine:
- the forward-only figure of the same model (8 x 1008x1008, pixels already on the device, two
  batches in flight as the server keeps them), in its own process before the server starts;
- new images (every request a JPEG never seen before, one image per request, bf16 out, received as a
  plain client receives it: ml_dtypes.bfloat16, no float32 widening) at each ``--concurrency``
  level: images/s, latency p50/p99, and the server's own stage timings per image (queue,
  preprocess, forward) as it reports them in each response;
- cache hits of the same embedding: latency p50/p99 from one client, and throughput from 32;
- the ratio of new-image throughput to the forward-only figure.

``encoder-service bench video`` runs clips and then images of the same token size through one server
instead, with these options and video.py's.

Clients run in ``--client-procs`` processes (each with threads), so the client side is not the
bottleneck of a Python GIL. ``--server-cwd`` runs the server from another checkout (a baseline) with
the same client and images.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from . import video as video_bench
from .report import forward_totals, forward_under_load, summary
from .service_clients import CLIENT_SHARED_MEMORY, SHM, cache_hits, drive, make_images

# A source checkout runs its own server and client (--server-cwd); an installed package, whatever
# the environment imports.
_CHECKOUT = Path(__file__).resolve().parents[2]
ROOT = _CHECKOUT if (_CHECKOUT / "pyproject.toml").is_file() else Path.cwd()


# --- forward only ------------------------------------------------------------------------------


def forward_only(args) -> dict:
    """Images/s of the forward alone in a child process (owns the GPU), for each batch size of
    ``--forward-batches`` (the service's batches under load are mixed sizes: compare like with like),
    each image the grid the processor makes of a 1008x1008 image (each side rounded to the merge unit:
    72 x 72 patches at patch 14, 64 x 64 at patch 16). Returns the largest batch's figure with every
    size's under ``by_batch``."""
    sizes = sorted({int(b) for b in str(args.forward_batches).split(",") if b.strip()})
    code = f"""
import json, time, torch
from encoder_service.models import load_vision_model
m = load_vision_model({args.model!r}, device={args.device!r}, dtype={args.dtype!r}, attn_backend={args.attn_backend!r})
unit = m.spec.patch_size * m.spec.spatial_merge_size
side = round(1008 / unit) * m.spec.spatial_merge_size
out = {{}}
for b in {sizes!r}:
    grids = [[1, side, side]] * b
    x = torch.randn(sum(t*h*w for t, h, w in grids), m.spec.patch_dim, device=m.device).to(m.dtype)
    for _ in range(3):
        m.encode_async(x, grids).wait()
    n = {args.forward_iters}
    t = time.perf_counter(); pending = None
    for _ in range(n):
        nxt = m.encode_async(x, grids)
        if pending is not None: pending.wait()
        pending = nxt
    pending.wait()
    s = time.perf_counter() - t
    out[b] = {{"batch": b, "images_per_s": b * n / s, "batch_ms": s / n * 1000, "ms_per_image": s / n / b * 1000}}
print("RESULT", json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=args.server_cwd,
                          env=_server_env(args), timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            by_batch = json.loads(line[7:])
            return {**by_batch[str(sizes[-1])], "by_batch": by_batch}
    raise RuntimeError(f"forward-only run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


# --- the server ----------------------------------------------------------------------------------


def _server_env(args) -> dict:
    env = dict(os.environ)
    paths = [str(Path(args.server_cwd).resolve()), str(Path(args.server_cwd).resolve() / "client")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_shallow_model(args, result: dict) -> None:
    """``--depth``: the run serves ``args.model`` cut to its first ``args.depth`` blocks, a checkpoint written
    beside ``--out`` (or in the working directory); ``result["model"]`` says so."""
    from ..models.presets import write_shallow_checkpoint

    narrow = getattr(args, "narrow", False)
    out_dir = (args.out.parent if args.out else Path.cwd()) / f"{args.model}-depth{args.depth}{'-narrow' * narrow}"
    args.model = str(write_shallow_checkpoint(args.model, args.depth, out_dir, narrow=narrow))
    result["model"] = f"{result['model']} with {args.depth} block(s){', 64 wide' * narrow} ({args.model})"


def start_server(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "encoder_service", "serve", "--model", args.model, "--device", args.device,
           "--dtype", args.dtype, "--attn-backend", args.attn_backend, "--host", "127.0.0.1",
           "--port", str(port), *args.serve_args]
    if "--metrics-port" not in args.serve_args:  # the forward per image under load comes from /metrics
        args.metrics_port = _free_port()
        cmd += ["--metrics-port", str(args.metrics_port)]
    log = open(log_path, "w")  # noqa: SIM115 (lives as long as the server)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=args.server_cwd, env=_server_env(args))
    target = f"127.0.0.1:{port}"
    from encoder_client import EncoderClient

    deadline = time.monotonic() + args.start_timeout_s
    with EncoderClient(target) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if client.health(timeout_s=2) == "SERVING":
                    return proc, target
            except Exception:
                pass
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not SERVING within {args.start_timeout_s} s:\n{log_path.read_text()[-4000:]}")


def children_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid``'s live child processes (its relays with --grpc-processes, its device
    workers with --devices), from /proc; 0 where there is no /proc."""
    return sum(children_cpu(pid).values())


def _stat(path: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) from a /proc ``stat`` file; None where it cannot be read."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    # fields after the name: state, ppid, ..., utime (12), stime (13)
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / tick


def children_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each of ``pid``'s live child processes, by pid, from /proc; {} where there is none."""
    found = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit() and (stat := _stat(f"/proc/{entry}/stat")) is not None and stat[0] == pid:
            found[int(entry)] = stat[1]
    return found


def thread_cpu_seconds(pid: int, tid: int | None = None) -> float | None:
    """CPU seconds of one thread of ``pid`` (its main thread by default: a server's event loop), from
    /proc; None where there is none."""
    stat = _stat(f"/proc/{pid}/task/{pid if tid is None else tid}/stat")
    return None if stat is None else stat[1]


def stop_process(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM, and SIGKILL when it has not exited within timeout_s (a draining server finishes its
    requests first)."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def split_serve_args(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """(the bench's own arguments, the server's flags after ``--``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def main(argv: list[str] | None = None, video: bool = False) -> int:
    """``encoder-service bench service``, or with ``video`` ``encoder-service bench video``: both drive one
    server the same way, and video's options add to these."""
    argv, serve_args = split_serve_args(argv)
    name = "video" if video else "service"
    p = argparse.ArgumentParser(prog=f"encoder-service bench {name}",
                                description=(video_bench.__doc__ if video else __doc__).split("\n\n")[0])

    def images_only(text: str | None = None) -> str | None:
        # Video never reads these, yet takes them: scripts written for `bench --service --video` pass them.
        return argparse.SUPPRESS if video else text

    p.add_argument("--model", default="qwen2.5-vl-7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attn-backend", default="auto")
    p.add_argument("--image-size", type=int, default=1008, help=images_only("side of the new images' JPEGs (square)"))
    p.add_argument("--concurrency", default="1,16" if video else "1,8,32", help="comma-separated client counts")
    p.add_argument("--seconds", type=float, default=15.0, help="measured time per concurrency level")
    p.add_argument("--images-per-level", type=int, default=100000 if video else 1200,
                   help="images a level sends, at most (a level also ends after --seconds)" if video
                   else "distinct JPEGs generated per level")
    p.add_argument("--client-procs", type=int, default=8)
    p.add_argument("--hit-iters", type=int, default=50, help=images_only())
    p.add_argument("--forward-iters", type=int, default=10, help=images_only())
    p.add_argument("--forward-batches", default="1,4,8",
                   help=images_only("batch sizes of the forward-only figure (the largest is the one ratios use)"))
    p.add_argument("--client-start-s", type=float, default=8.0,
                   help="seconds the client processes get to start and warm up before a level's measured window")
    p.add_argument("--repeat-images", action="store_true",
                   help="clients go round their images again instead of stopping; with a server run with "
                        "--cache-bytes 0 every request is still new work, and a few hundred JPEGs last any level")
    p.add_argument("--depth", type=int, default=None,
                   help="serve the model with only this many blocks (a checkpoint written for the run): "
                        "the forward becomes a small part of an image's cost, so what is measured is the "
                        "front end (decode, hashing, transport) and the device's preprocessing")
    p.add_argument("--no-forward-only", action="store_true", help=images_only())
    p.add_argument("--no-hits", action="store_true", help=images_only())
    p.add_argument("--transports", default="stream",
                   help=f"comma-separated: stream (embeddings on the gRPC stream), {SHM} (written into the "
                        f"client's shared memory; the server gets --shared-memory on), default (a plain "
                        "EncoderClient, as users run it); each level runs once per transport, on new images"),
    p.add_argument("--server-cwd", default=str(ROOT), help="checkout the server (and forward-only) run from")
    p.add_argument("--start-timeout-s", type=float, default=600)
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path, default=None)
    if video:
        video_bench.add_arguments(p)
    args = p.parse_args(argv)
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if not transports or set(transports) - set(CLIENT_SHARED_MEMORY):
        p.error(f"--transports: some of {', '.join(CLIENT_SHARED_MEMORY)}, got {args.transports!r}")
    if SHM in transports and "--shared-memory" not in serve_args:
        serve_args = [*serve_args, "--shared-memory", "on"]
    args.serve_args = serve_args
    levels = [int(c) for c in args.concurrency.split(",")]
    runs = [(c, t) for c in levels for t in transports]
    command = " ".join([f"encoder-service bench {name}", *argv, *(["--", *serve_args] if serve_args else [])])

    result: dict = {"label": args.label, "date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
                    "cpus": os.cpu_count(), "command": command,
                    "model": args.model, "device": args.device, "dtype": args.dtype, "serve_args": serve_args}
    try:
        import torch

        if torch.cuda.is_available():
            result["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    if args.depth is not None:
        use_shallow_model(args, result)
    if video:
        return video_bench.run_video(args, result, levels, transports, start_server, stop_process)
    t0 = time.perf_counter()
    images = make_images(args.images_per_level * len(runs), first_seed=1000, procs=min(16, os.cpu_count() or 2),
                         size=args.image_size)
    result["jpeg_bytes_mean"] = float(np.mean([len(i) for i in images[:50]]))
    print(f"generated {len(images)} JPEGs ({result['jpeg_bytes_mean'] / 1e3:.0f} KB each) in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    if not args.no_forward_only:
        result["forward_only"] = forward_only(args)
        print("forward only:", result["forward_only"], flush=True)
    log_path = (args.out.with_suffix(".server.log") if args.out else Path("service_bench.server.log"))
    proc, target = start_server(args, log_path)
    try:
        result["new_images"] = []
        for i, (c, transport) in enumerate(runs):
            level_images = images[i * args.images_per_level:(i + 1) * args.images_per_level]
            r = drive(target, c, level_images, args, warmup=2, transport=transport,
                      sample=lambda: {**forward_totals(args), "children_cpu_seconds": children_cpu_seconds(proc.pid)})
            window = r.pop("window", {})
            r.update(forward_under_load(window.get("before"), window.get("after")))
            print("new images:", json.dumps(r), flush=True)
            result["new_images"].append(r)
        if not args.no_hits:
            result["cache_hits"] = [cache_hits(target, args, t) for t in transports]
            print("cache hits:", json.dumps(result["cache_hits"]), flush=True)
    finally:
        stop_process(proc)
    fo = result.get("forward_only", {}).get("images_per_s")
    if fo:
        for r in result["new_images"]:
            if r.get("images_per_s"):
                r["ratio_to_forward_only"] = r["images_per_s"] / fo
    print(summary(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
