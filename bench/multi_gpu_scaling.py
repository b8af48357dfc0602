"""One node, one and several GPUs, through the service: the same images, clients and flags against
``--devices 0`` and ``--devices 0,1`` (or any ``--setups``) in one run.

    python bench/multi_gpu_scaling.py --setups "0;0,1" --concurrency 64 --seconds 15 \
        [--transport shared-memory] --out scaling.json [-- EXTRA SERVE FLAGS]

For each setup: a fresh server process (so every image is new to its cache), ``--concurrency``
clients in client processes sending photo-like 1008x1008 JPEGs one per request (bf16 out; the
embeddings come back on the gRPC stream, or with ``--transport shared-memory`` are written into the
clients' shared memory, the server run with ``--shared-memory on``), and
while it is loaded, ``nvidia-smi --query-compute-apps``: which processes hold a CUDA context on
which GPU, checked against the server's own process (the front end, which must hold none) and its
worker processes (one per GPU, each on its own). Prints images/s per setup and the ratio of each to
the first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from encoder_service.benchmarks.report import forward_totals, forward_under_load  # noqa: E402
from encoder_service.benchmarks.service import (  # noqa: E402
    children_cpu,
    split_serve_args,
    start_server,
    stop_process,
    thread_cpu_seconds,
    use_shallow_model,
)
from encoder_service.benchmarks.service_clients import SHM, drive, make_images  # noqa: E402


def _smi(*query: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=True).stdout
    return [[field.strip() for field in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def gpu_processes(front_pid: int, log_text: str) -> dict:
    """Who holds a CUDA context where, for the server's processes."""
    index_of = {uuid: int(index) for index, uuid in _smi("--query-gpu=index,uuid")}
    apps = [(int(pid), index_of.get(uuid, -1), float(mem)) for pid, uuid, mem in
            _smi("--query-compute-apps=pid,gpu_uuid,used_memory")]
    workers = {label: int(pid) for label, pid in re.findall(r"worker on (\S+) \(pid (\d+)\)", log_text)}
    on_gpu: dict[int, list[int]] = {}
    for pid, gpu, _ in apps:
        on_gpu.setdefault(pid, []).append(gpu)
    return {
        "front_end_pid": front_pid,
        "front_end_gpus": on_gpu.get(front_pid, []),
        "workers": {label: {"pid": pid, "gpus": on_gpu.get(pid, [])} for label, pid in workers.items()},
        "compute_apps": [{"pid": pid, "gpu": gpu, "used_memory_mib": mem} for pid, gpu, mem in apps],
    }


def profile(pid: int, stem: Path) -> None:
    """Where the CPU goes under load: every thread of the machine from top, and the server's Python
    stacks from py-spy as collapsed stacks: 5 s of every running thread (front end and workers; by
    thread, so the event loop's own share shows),
    then 5 s of the front end's GIL holder only."""
    with open(f"{stem}.top.txt", "w") as f:
        subprocess.run(["top", "-b", "-H", "-n", "1", "-w", "400"], stdout=f, stderr=subprocess.STDOUT, timeout=30)
    for name, extra in (("pyspy", ["--subprocesses", "--threads"]), ("pyspy-gil", ["--gil"])):
        # --gil: only samples of the thread holding the GIL; their sum over threads is the share
        # of the time the GIL was held at all.
        subprocess.run(["py-spy", "record", "-p", str(pid), *extra, "--nonblocking", "-d", "5", "-r", "200",
                        "--format", "raw", "-o", f"{stem}.{name}.txt"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=60)


def images_by_device(args) -> dict[str, float]:
    """Images each device ran so far (``encoder_service_batch_images_sum{device}``), from /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{args.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {sample.labels["device"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "encoder_service_batch_images_sum"}


def cpu_by_process(before: dict, after: dict, log_text: str) -> dict:
    """Over the measured window: each worker's CPU per image it ran, and the relays' per image of the node:
    every other child of the server, the relays of --grpc-processes and also the video decoder processes
    and multiprocessing's resource tracker, which an image load leaves idle."""
    workers = {int(pid): label for label, pid in re.findall(r"worker on (\S+) \(pid (\d+)\)", log_text)}
    images = after["images"] - before["images"]
    out: dict = {"worker_cpu_ms_per_image": {}}
    relays = 0.0
    for pid, seconds in after["children"].items():
        spent = seconds - before["children"].get(pid, 0.0)
        if pid in workers:
            label = workers[pid]
            ran = after["by_device"].get(label, 0.0) - before["by_device"].get(label, 0.0)
            out["worker_cpu_ms_per_image"][label] = 1000 * spent / ran if ran else None
        else:
            relays += spent
    if images:
        out["relays_cpu_ms_per_image"] = 1000 * relays / images
    out.update(event_loop_load(before, after))
    return out


def event_loop_load(before: dict, after: dict) -> dict:
    """The front end's event loop (its main thread) over the measured window: CPU per image, its busy
    share of the window, and the images/s at which that one thread would be busy all the time, the
    front end's bound however many devices it feeds (its other threads grow with the devices)."""
    images = after["images"] - before["images"]
    if not images or before.get("loop_cpu") is None or after.get("loop_cpu") is None:
        return {}
    spent, wall = after["loop_cpu"] - before["loop_cpu"], after["wall"] - before["wall"]
    out = {"event_loop_cpu_ms_per_image": 1000 * spent / images}
    if spent > 0 and wall > 0:
        out["event_loop_busy_share"] = spent / wall
        out["event_loop_saturates_at_images_per_s"] = images / spent
    return out


def cached_images(args) -> list[bytes]:
    """``--images`` photo-like JPEGs (seeds from 5000), through ``--images-cache`` when given."""
    cache = args.images_cache
    if cache is not None and cache.exists():
        images = pickle.loads(cache.read_bytes())
        if len(images) >= args.images:
            return images[:args.images]
    images = make_images(args.images, first_seed=5000, procs=min(32, os.cpu_count() or 2))
    if cache is not None:
        cache.write_bytes(pickle.dumps(images))
    return images


def run_setup(devices: str, images: list[bytes], args) -> dict:
    # "in-process": the one-device server without worker processes (--device cuda), for comparison.
    args.serve_args = [*args.extra] if devices == "in-process" else ["--devices", devices, *args.extra]
    if args.transport == SHM and "--shared-memory" not in args.serve_args:
        args.serve_args.extend(["--shared-memory", "on"])
    log_path = (args.out.with_suffix(f".devices-{devices.replace(',', '_')}.log") if args.out
                else Path(f"scaling.devices-{devices.replace(',', '_')}.log"))
    proc, target = start_server(args, log_path)
    snapshot: dict = {}

    def look_while_loaded() -> None:
        time.sleep(args.client_start_s + 0.1 * args.concurrency + 2.0)  # inside the measured window
        # (the profile takes about 12 s: give a profiled setup --seconds 16 or more)
        try:
            snapshot.update(gpu_processes(proc.pid, log_path.read_text()))
        except Exception as exc:  # no nvidia-smi: report it rather than fail the measurement
            snapshot["error"] = repr(exc)
        if devices in args.profile:
            profile(proc.pid, log_path.with_suffix(""))

    looker = threading.Thread(target=look_while_loaded)
    looker.start()
    try:
        result = drive(target, args.concurrency, images, args, warmup=2, transport=args.transport,
                       sample=lambda: {**forward_totals(args), "children": children_cpu(proc.pid),
                                       "by_device": images_by_device(args), "wall": time.monotonic(),
                                       "loop_cpu": thread_cpu_seconds(proc.pid)})
    finally:
        looker.join()
        stop_process(proc)
    window = result.pop("window", {})
    # Over the measured window: the front-end process's own CPU per image (the workers are other
    # processes), and the devices' forward time per image summed over devices.
    before, after = window.get("before"), window.get("after")
    result.update(forward_under_load(before, after))
    if before and after:
        result.update(cpu_by_process(before, after, log_path.read_text()))
    result["devices"] = devices
    result["gpu_processes"] = snapshot
    return result


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_serve_args(argv)
    p = argparse.ArgumentParser(prog="multi_gpu_scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default="0;0,1", help="--devices values separated by ';' (the first is the base); "
                   "'in-process' is the one-GPU server without worker processes")
    p.add_argument("--model", default="qwen2.5-vl-7b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", help="--device of the in-process setup (--devices decides the others)")
    p.add_argument("--attn-backend", default="auto")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--images", type=int, default=2400, help="distinct JPEGs, reused by every setup (fresh servers)")
    p.add_argument("--client-procs", type=int, default=8)
    p.add_argument("--transport", choices=["stream", SHM], default="stream",
                   help=f"how embeddings come back: on the gRPC stream, or ({SHM}) written by the server into "
                        "the clients' shared memory (clients on the server's host)")
    p.add_argument("--client-start-s", type=float, default=8.0,
                   help="seconds the client processes get to start and warm up before the measured window")
    p.add_argument("--start-timeout-s", type=float, default=600)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--profile", default="", help="setups (';'-separated) to profile with top and py-spy while loaded")
    p.add_argument("--images-cache", type=Path, default=None,
                   help="a file keeping the generated JPEGs: read when it holds at least --images of them, else "
                        "written (runs of several trees or transports then send the same images)")
    p.add_argument("--depth", type=int, default=None,
                   help="the model cut to its first N blocks (same widths, preprocessing and output size): with 1, "
                        "the devices' forward is nearly free and images/s is what the front end and the workers' "
                        "host work can carry")
    p.add_argument("--narrow", action="store_true",
                   help="with --depth: the blocks 64 wide too (Qwen2.5-VL; the output width stays): on CPU workers "
                        "(--setups cpu,cpu --device cpu) the forward then costs little as well, and the front end's "
                        "CPU per image can be measured on a host without a GPU")
    args = p.parse_args(argv)
    args.extra = extra
    args.repeat_images = False  # every request a new image: the clients stop when theirs run out
    args.profile = [x for x in args.profile.split(";") if x]
    args.server_cwd = str(ROOT)

    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "cpus": os.cpu_count(),
                    "command": " ".join(["bench/multi_gpu_scaling.py", *sys.argv[1:]]), "model": args.model,
                    "dtype": args.dtype, "concurrency": args.concurrency, "transport": args.transport}
    if args.depth is not None:
        use_shallow_model(args, result)
    with contextlib.suppress(Exception):  # no nvidia-smi: the figures stand without the names
        result["gpus"] = [name for (name,) in _smi("--query-gpu=name")]
    t0 = time.perf_counter()
    images = cached_images(args)
    print(f"generated {len(images)} JPEGs in {time.perf_counter() - t0:.0f} s", flush=True)
    result["setups"] = []
    for devices in args.setups.split(";"):
        r = run_setup(devices, images, args)
        print(f"--devices {devices}:", json.dumps(r), flush=True)
        result["setups"].append(r)
    base = result["setups"][0].get("images_per_s")
    for r in result["setups"]:
        if base and r.get("images_per_s"):
            r["ratio_to_first"] = r["images_per_s"] / base
        print(f"--devices {r['devices']:>8}: {r.get('images_per_s', 0):6.1f} img/s (x{r.get('ratio_to_first', 0):.2f})"
              f"  p50 {r.get('latency_p50_ms', 0):.0f} ms p99 {r.get('latency_p99_ms', 0):.0f} ms  server p50: "
              f"queue {r.get('server_queue_ms_p50', 0):.1f} preprocess {r.get('server_preprocess_ms_p50', 0):.1f} "
              f"forward {r.get('server_forward_ms_p50', 0):.1f} ms; front-end CPU "
              f"{r.get('server_cpu_ms_per_image', 0):.1f} ms an image (its event loop "
              f"{r.get('event_loop_cpu_ms_per_image', 0):.1f}: busy {100 * r.get('event_loop_busy_share', 0):.0f}%, "
              f"saturated at {r.get('event_loop_saturates_at_images_per_s', 0):.0f} img/s), relays "
              f"{r.get('relays_cpu_ms_per_image', 0):.1f}, workers "
              f"{r.get('worker_cpu_ms_per_image', {})}, clients' CPU "
              f"{r.get('client_cpu_ms_per_image', 0):.1f} ms an image", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
