"""The reliability scenarios of tests/reliability, run for long: a soak (``encoder-service bench
reliability``; ``python bench/soak.py`` from a checkout runs the same).

    encoder-service bench reliability                     # 10 minutes of sustained load, the rest scaled
    encoder-service bench reliability --minutes 1 --scenarios sustained,fuzz --out soak.json --markdown soak.md
    encoder-service bench reliability --device cuda --model qwen2.5-vl-7b --dtype bfloat16

``--minutes`` is the sustained load's measured time; the other scenarios scale with it (longer
overload, more cancelling callers, more sink-fault rounds, more fuzz examples). Prints one table
(scenario, figures, pass/fail), writes every figure and check as JSON (``--out``) and the table as
Markdown ready for the docs' "Reliability" page, with date, machine and command
(``--markdown``). Exit status 0 when every check of every scenario passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from encoder_service.benchmarks.reliability.result import ScenarioResult
from encoder_service.benchmarks.reliability.scenarios import (
    cancellation,
    failover,
    fuzz,
    overload,
    sigterm,
    sink_faults,
    sustained,
    video_flood,
)
from encoder_service.benchmarks.reliability.server import ServerSpec

SCENARIOS = ("sustained", "overload", "cancellation", "sigterm", "sigterm_burst", "failover", "sink_faults", "fuzz",
             "video_flood")

# The figures each scenario shows in the table (all of them are in the JSON).
HEADLINES = {
    "sustained_load": ["req_per_s", "latency_p50_ms", "latency_p99_ms", "hit_latency_p99_ms", "rss_growth_pct",
                       "cache_growth_pct", "longest_gap_s", "resource_exhausted"],
    "overload": ["overload_factor", "refusal_p99_ms", "health_p99_ms", "hit_p99_ms", "admitted_p99_ms", "queue_max",
                 "recovery_s"],
    "cancellation": ["callers", "drain_s", "work_skipped_pct", "old_entries_left"],
    "sigterm": ["in_flight_at_sigterm", "in_flight_completed", "unavailable_after_sigterm", "cancelled_after_sigterm",
                "exit_s", "exit_code"],
    "sigterm_burst": ["calls", "ok", "unavailable", "cancelled", "exit_s"],
    "failover": ["requests", "lost", "before_p50_ms", "before_p99_ms", "failover_p50_ms", "failover_p99_ms",
                 "failover_max_ms"],
    "sink_faults": ["down_s", "never_ack_s", "failure_spread_s", "caller_deadline_s", "flapping_ok", "others_p99_ms",
                    "rss_growth_mib"],
    "fuzz": ["calls", "code_ok", "code_invalid_argument", "slowest_call_s", "max_response_overhead_pct"],
    "video_flood": ["image_alone_p99_ms", "image_flood_p99_ms", "clip_alone_p99_ms", "clip_flood_p99_ms",
                    "normal_flood_errors", "hostile_calls", "rss_peak_growth_mib", "rss_after_growth_mib"],
}


def run_scenario(name: str, minutes: float, spec: ServerSpec, log_dir: Path, args) -> ScenarioResult:
    scale = max(1.0, minutes)  # CI's short runs are scale 1
    if name == "sustained":
        return sustained.run(duration_s=minutes * 60, warmup_s=max(8.0, min(60.0, minutes * 6)), streams=args.streams,
                             cache_bytes=args.cache_bytes or ((128 << 20) if spec.model else (4 << 20)),
                             spec=spec, log_dir=log_dir)
    if name == "overload":
        return overload.run(duration_s=10.0 * scale, rate=args.overload_rate,
                            spec=spec, log_dir=log_dir)
    if name == "cancellation":
        return cancellation.run(callers=int(240 * scale), spread_s=3.0 * scale, crashing=2 + int(scale),
                                spec=spec, log_dir=log_dir)
    if name == "sigterm":
        return sigterm.run(streams=args.streams // 4, load_s=3.0 * scale, spec=spec, log_dir=log_dir)
    if name == "sigterm_burst":
        return sigterm.run_burst(calls=int(300 * scale), spec=spec, log_dir=log_dir)
    if name == "failover":
        return failover.run(before_s=5.0 * scale, after_s=6.0 * scale, spec=spec, log_dir=log_dir)
    if name == "sink_faults":
        # On a GPU the first forwards of new shapes grow pinned staging buffers and library caches for
        # a while: the sustained scenario holds memory flat after warm-up; here a looser bound.
        return sink_faults.run(rounds=int(3 * scale), spec=spec, log_dir=log_dir,
                               max_rss_growth_mib=64.0 if spec.device == "cpu" else 256.0)
    if name == "fuzz":
        return fuzz.run(max_examples=int(1000 * scale), image_examples=int(1000 * scale), seed=None, spec=spec,
                        log_dir=log_dir)
    if name == "video_flood":
        # Each phase (normal traffic alone, then with the flood) 10 s in CI, 15 s a minute here; full-size
        # decode bombs (18000 frames, --max-video-frames' default) instead of CI's 1800.
        return video_flood.run(duration_s=15.0 * scale, spec=spec, log_dir=log_dir,
                               hostility=video_flood.Hostility(bomb_frames=18000),
                               max_rss_after_growth_mib=64.0 if spec.device == "cpu" else 256.0)
    raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{os.cpu_count()} x {cpu}, {platform.system()} {platform.release()}, Python {platform.python_version()}"
    if shutil.which("nvidia-smi"):
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, check=False).stdout.strip().splitlines()
        if gpus:
            text += f", {len(gpus)} x {gpus[0]}"
    return text


def _fmt(value: float) -> str:
    if value != value:
        return "n/a"
    return f"{value:.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.3g}"


def rows(results: list[ScenarioResult]) -> list[tuple[str, str, str]]:
    out = []
    for r in results:
        shown = ", ".join(f"{k} {_fmt(r.figures[k])}" for k in HEADLINES.get(r.name, []) if k in r.figures)
        failed = "; ".join(c.name for c in r.failures())
        out.append((r.name, shown, "pass" if r.passed else f"FAIL: {failed}"))
    return out


def markdown(results: list[ScenarioResult], header: dict) -> str:
    lines = [f"Soak of {header['date']} on {header['machine']}, `--minutes {header['minutes']:g}`",
             f"(`{header['command']}`, {header['seconds']:.0f} s in all):", "",
             "| scenario | figures | result |", "| --- | --- | --- |"]
    lines += [f"| {name} | {shown} | {verdict} |" for name, shown, verdict in rows(results)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="encoder-service bench reliability", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="measured time of the sustained load")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (passed to the servers)")
    parser.add_argument("--model", default="", help="preset or checkpoint; default: the tiny preset")
    parser.add_argument("--dtype", default="", help="e.g. bfloat16 on a GPU; default: the server's")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of: "
                        + ", ".join(SCENARIOS))
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams of the sustained load")
    parser.add_argument("--cache-bytes", type=int, default=0, help="sustained load's --cache-bytes "
                        "(default: 4 MiB on the tiny preset, 128 MiB otherwise; the warm-up must fill it)")
    parser.add_argument("--overload-rate", type=float, default=0.0, help="offered requests/s in the overload "
                        "(default: 8x what a 3 s flood gets served just before; must be >= 4x what "
                        "the server serves)")
    parser.add_argument("--out", type=Path, help="write every figure and check as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the table as Markdown here")
    parser.add_argument("--log-dir", type=Path, help="where the servers' logs go (default: a temporary folder)")
    args = parser.parse_args(argv)

    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    spec = ServerSpec(model=args.model, device=args.device, dtype=args.dtype)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="encoder-soak-"))
    header = {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(),
              "command": "encoder-service bench reliability " + shlex.join(sys.argv[1:] if argv is None else argv),
              "minutes": args.minutes, "device": args.device, "model": args.model or "tiny-qwen2.5-vl",
              "log_dir": str(log_dir)}
    started = time.monotonic()
    results = []
    for name in names:
        t = time.monotonic()
        print(f"--- {name} ...", flush=True)
        try:
            result = run_scenario(name, args.minutes, spec, log_dir, args)
        except Exception as exc:  # a scenario that could not run is a failed row, not a lost soak
            result = ScenarioResult(name)
            result.check("scenario ran", False, f"{type(exc).__name__}: {exc}"[:500])
        result.figure("scenario_s", time.monotonic() - t)
        print(result.report(), flush=True)
        results.append(result)
    header["seconds"] = time.monotonic() - started

    print()
    table = rows(results)
    width = max(len(r[0]) for r in table)
    for name, shown, verdict in table:
        print(f"{name:<{width}}  {verdict:<6}  {shown}")
    print(f"\n{header['command']}: {header['seconds']:.0f} s on {header['machine']}; server logs in {log_dir}")
    if args.out:
        args.out.write_text(json.dumps({**header, "results": [r.to_json() for r in results]}, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(results, header))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
