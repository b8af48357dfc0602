"""What handing a clip's decoded frames from a decode process to the server costs the server: clips
through ``VideoDecodePool`` (the service's decode processes) one after the other, with the server
process's CPU per clip (its own threads: sending the clip, receiving and unpacking the frames), the
decode processes' CPU per clip, and the wall time per clip.

    python bench/video_pool_cpu.py [--seconds 10,30] [--size 1280x720] [--clips 6] [--repo PATH] [--out FILE]

``--repo``: the checkout whose ``encoder_service`` runs (another commit's worktree, to compare two in
one run on the same clips); the clips are made once with this checkout's generator (the service
benchmark's photo-like pan with its sensor noise, x264 30 fps, P-frames: nothing for the H.264 skip to
pass over, so the decode is the same work in every commit) and cached under ``--clip-dir``. Sampled at 2
fps as the Qwen references do (every 15th frame). The decode processes' CPU is read from /proc through
psutil (``pip install psutil``; not one of the service's dependencies).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def every_nth(step: int, facts) -> list[int]:
    """The frames the Qwen references sample at 2 fps from a 30 fps clip (picklable through ``partial``)."""
    return list(range(0, facts.total_frames, step))


def clip_file(clip_dir: Path, seconds: float, width: int, height: int) -> Path:
    path = clip_dir / f"photo-{seconds:g}s-{width}x{height}.mp4"
    if not path.exists():
        sys.path.insert(0, str(HERE))
        from encoder_service.benchmarks.video import photo_clip

        clip_dir.mkdir(parents=True, exist_ok=True)
        path.write_bytes(photo_clip(0, seconds, width, height, 30))
    return path


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children_cpu_s() -> float:
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


async def measure(data: bytes, clips: int) -> dict:
    from encoder_service.preprocess.video_decode import VideoLimits
    from encoder_service.preprocess.video_pool import VideoDecodePool

    limits = VideoLimits(max_bytes=1 << 30, max_frames=100_000, max_seconds=3600.0,
                         max_frame_pixels=1 << 26, max_decode_seconds=600.0)
    pick = functools.partial(every_nth, 15)
    with VideoDecodePool(1) as pool:
        first = await pool.decode(data, pick, limits)  # the child started and warm
        shape = list(first.frames.shape) if hasattr(first, "frames") else None
        walls, selfs, kids = [], [], []
        for _ in range(clips):
            s0, k0, w0 = self_cpu_s(), children_cpu_s(), time.perf_counter()
            out = await pool.decode(data, pick, limits)
            walls.append(time.perf_counter() - w0)
            selfs.append(self_cpu_s() - s0)
            kids.append(children_cpu_s() - k0)
            del out
    return {"frames_shape": shape, "wall_s": round(statistics.median(walls), 3),
            "server_cpu_s": round(statistics.median(selfs), 3),
            "decoder_cpu_s": round(statistics.median(kids), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", default="10,30", help="clip lengths, comma-separated")
    p.add_argument("--size", default="1280x720")
    p.add_argument("--clips", type=int, default=6, help="timed clips per length (after one warm-up clip)")
    p.add_argument("--repo", type=Path, default=HERE, help="the checkout whose encoder_service runs")
    p.add_argument("--clip-dir", type=Path, default=Path("/tmp/encoder-bench-clips"))
    p.add_argument("--out", type=Path)
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one clip file in this process
    args = p.parse_args()
    if args.one:
        sys.path.insert(0, str(args.repo))
        print(json.dumps(asyncio.run(measure(Path(args.one).read_bytes(), args.clips))))
        return 0
    width, height = (int(n) for n in args.size.split("x"))
    commit = subprocess.run(["git", "-C", str(args.repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"repo": str(args.repo), "commit": commit, "machine": platform.processor() or platform.machine(),
              "python": platform.python_version(), "rows": []}
    for seconds in (float(s) for s in args.seconds.split(",")):
        path = clip_file(args.clip_dir, seconds, width, height)
        # A fresh interpreter per row: the other checkout's modules only, nothing of this one imported.
        done = subprocess.run([sys.executable, __file__, "--one", str(path), "--repo", str(args.repo),
                               "--clips", str(args.clips)], capture_output=True, text=True, check=True)
        row = {"clip": f"{seconds:g} s {width}x{height} 30 fps", "bytes": path.stat().st_size,
               **json.loads(done.stdout.strip().splitlines()[-1])}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
