"""Where a lone image's time goes, stage by stage: a real server with the stage tracer
(bench/stage_trace_site/sitecustomize.py), one client sending new photo-like JPEGs one at a time.

    python3 bench/stage_trace.py run --out DIR [--model qwen2.5-vl-7b --device cuda --dtype bfloat16]
        [--sizes 448,1008] [--images 60] [--gap-s 0.05] [--serve-args "..."]
    python3 bench/stage_trace.py summary DIR

``run`` starts the server with the tracer on, sends ``--images`` new JPEGs of each size (``--gap-s`` of quiet
before each), notes the client's own stages beside the server's (``c:`` tags), stops the server and prints
the summary. ``summary`` prints, per image size, the median time from each call's start to the first time
each stage was entered (``>``) or left (``<``); the first 5 calls of a size are not counted. The files:
``server.txt`` and ``client.txt`` (``perf_counter_ns tag thread`` lines) and ``calls.json`` (each call's
start and end, by size).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "client"))

SITE = HERE / "bench" / "stage_trace_site"
SKIPPED_CALLS = 5


def read_events(path: Path) -> list[tuple[int, str]]:
    if not path.exists():
        return []
    with open(path) as lines:
        return [(int(t), tag) for t, tag, *_ in (line.split(None, 2) for line in lines if line.strip())]


def stage_medians(events: list[tuple[int, str]], calls: list[tuple[int, int]], skip: int = SKIPPED_CALLS
                  ) -> list[tuple[str, float]]:
    """(stage, median ms from the call's start to its first occurrence in the call), in time order, and
    ("END", the calls' median length)."""
    events = sorted(events)
    at: dict[str, list[float]] = defaultdict(list)
    for start, end in calls[skip:]:
        seen = set()
        for t, tag in events:
            if start <= t <= end and tag not in seen:
                seen.add(tag)
                at[tag].append((t - start) / 1e6)
        at["END"].append((end - start) / 1e6)
    return sorted(((tag, statistics.median(ms)) for tag, ms in at.items()), key=lambda item: item[1])


def summary(out: Path) -> str:
    events = read_events(out / "server.txt") + read_events(out / "client.txt")
    calls = json.loads((out / "calls.json").read_text())
    lines = []
    for size, sized in calls.items():
        lines.append(f"== {size}x{size}, {max(0, len(sized) - SKIPPED_CALLS)} calls")
        lines += [f"{tag:22s} {ms:9.3f} ms" for tag, ms in stage_medians(events, [tuple(c) for c in sized])]
    return "\n".join(lines)


class ClientStages:
    """The client's own stages (its request built, the call, each chunk placed, the results), noted in
    this process."""

    def __init__(self) -> None:
        self.events: list[tuple[int, str]] = []

    def install(self) -> None:
        import encoder_client._reassembly as reassembly
        import encoder_client.client as client

        for owner, name, tag in ((client, "build_request", "build"), (client.EncoderClient, "_call_encode", "call"),
                                 (reassembly.Reassembler, "_place", "place"),
                                 (reassembly.Reassembler, "results", "results")):
            setattr(owner, name, self._noted(getattr(owner, name), "c:" + tag))

    def _noted(self, fn, tag: str):
        @functools.wraps(fn)
        def noted(*args, **kwargs):
            self.events.append((time.perf_counter_ns(), tag + ">"))
            try:
                return fn(*args, **kwargs)
            finally:
                self.events.append((time.perf_counter_ns(), tag + "<"))
        return noted


def run(args) -> int:
    from encoder_client import EncoderClient

    from encoder_service.benchmarks.service import start_server, stop_process
    from encoder_service.benchmarks.service_clients import make_images

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "server.txt").unlink(missing_ok=True)
    stages = ClientStages()
    stages.install()
    spec = SimpleNamespace(model=args.model, device=args.device, dtype=args.dtype, attn_backend="auto",
                           server_cwd=str(HERE), serve_args=shlex.split(args.serve_args), start_timeout_s=900)
    # The server inherits both: the tracer loads in it (and in any process it starts) as sitecustomize.
    saved = {key: os.environ.get(key) for key in ("STAGE_TRACE_OUT", "PYTHONPATH")}
    os.environ["STAGE_TRACE_OUT"] = str((out / "server.txt").resolve())
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), saved["PYTHONPATH"]]))
    try:
        proc, target = start_server(spec, out / "server.log")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    calls: dict[str, list[tuple[int, int]]] = {}
    try:
        with EncoderClient(target) as client:
            for size in args.sizes:
                calls[str(size)] = []
                for image in make_images(args.images, 10_000, 4, size):
                    time.sleep(args.gap_s)
                    started = time.perf_counter_ns()
                    client.encode([image], output_dtype="bfloat16", timeout_s=120)
                    calls[str(size)].append((started, time.perf_counter_ns()))
    finally:
        stop_process(proc)
    (out / "calls.json").write_text(json.dumps(calls))
    (out / "client.txt").write_text("".join(f"{t} {tag} client\n" for t, tag in stages.events))
    print(summary(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    traced = sub.add_parser("run", help="trace a server's lone images")
    traced.add_argument("--out", type=Path, required=True)
    traced.add_argument("--model", default="qwen2.5-vl-7b")
    traced.add_argument("--device", default="cuda")
    traced.add_argument("--dtype", default="bfloat16")
    traced.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[448, 1008])
    traced.add_argument("--images", type=int, default=60)
    traced.add_argument("--gap-s", type=float, default=0.05, help="quiet before each image")
    traced.add_argument("--serve-args", default="", help="serve flags (one string)")
    summed = sub.add_parser("summary", help="the summary of a run's files")
    summed.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "summary":
        print(summary(args.out))
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
