"""A server's first clips, one at a time: what a lightly loaded server's callers see right after it
starts (or after a quiet spell), when no clip has yet been decoded by most decoder processes.

    python bench/first_clips.py [--clips 20] [--repos .,/path/to/other/checkout] [--out FILE] -- [SERVE FLAGS]

For each checkout in ``--repos`` (another commit's worktree, to compare two in one run): a fresh server
process (``encoder-service serve`` run from that checkout, the given flags), then one client sending
``--clips`` clips one after the other, each new work (the same MP4 made distinct by an MP4 ``free``
box: another content hash, the same decode), and each clip's latency. The clip is the reliability
suite's 64x48 H.264 pattern (2 s at 10 fps, sampled at 2 fps): small, so its latency is the service's
overhead per clip, not its decode. Prints each checkout's latencies in order, then their median from
the ``--video-decode-processes``-th on.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_server(repo: Path, flags: list[str], clip: bytes, clips: int) -> list[float]:
    from encoder_client import EncoderClient, Video

    port = _port()
    log = open(f"/tmp/first_clips.{port}.log", "w")  # noqa: SIM115 (lives as long as the server)
    server = subprocess.Popen([sys.executable, "-m", "encoder_service", "serve", "--host", "127.0.0.1",
                               "--port", str(port), *flags], cwd=repo, stdout=log, stderr=subprocess.STDOUT)
    try:
        with EncoderClient(f"127.0.0.1:{port}", timeout_s=120) as client:
            deadline = time.monotonic() + 120
            while client_health(client) != "SERVING":
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server from {repo} did not start; its log: {log.name}")
                time.sleep(0.5)
            latencies = []
            for i in range(clips):
                start = time.perf_counter()
                client.encode([Video(clip + struct.pack(">I4sQ", 16, b"free", i), fps=2)])
                latencies.append(1000 * (time.perf_counter() - start))
            return latencies
    finally:
        server.terminate()
        server.wait(30)


def client_health(client) -> str:
    try:
        return client.health(timeout_s=2)
    except Exception:
        return "DOWN"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clips", type=int, default=20)
    p.add_argument("--repos", default=".", help="checkouts to run the server from, comma-separated")
    p.add_argument("--out", type=Path)
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    from encoder_service.benchmarks.reliability.video_inputs import make_clip

    clip = make_clip("mp4", "libx264", frames=20, width=64, height=48, fps=10)
    runs = []
    for repo in args.repos.split(","):
        root = Path(repo).resolve()
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True).stdout.strip()
        latencies = one_server(root, flags, clip, args.clips)
        runs.append({"repo": str(root), "commit": commit, "latencies_ms": latencies})
        print(f"{commit}: " + " ".join(f"{t:.0f}" for t in latencies) + " ms", flush=True)
    processes = int(flags[flags.index("--video-decode-processes") + 1]) if "--video-decode-processes" in flags else 3
    for run in runs:
        rest = run["latencies_ms"][1:processes]
        if rest:
            run["clips_2_to_processes_median_ms"] = statistics.median(rest)
        print(f"{run['commit']}: first {run['latencies_ms'][0]:.0f} ms, clips 2..{processes} median "
              f"{run.get('clips_2_to_processes_median_ms', float('nan')):.0f} ms, after them median "
              f"{statistics.median(run['latencies_ms'][processes:] or [float('nan')]):.0f} ms")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "host": platform.node(),
                                        "date": time.strftime("%Y-%m-%d"), "serve_flags": flags, "runs": runs},
                                       indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
