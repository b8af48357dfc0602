"""CPU time to decode a clip's sampled frames, skipping the unsampled non-reference frames of H.264
(preprocess/video_skip.py) against decoding every frame up to the last sampled one (the reference's way,
and this service's before the skip), in one process, one clip after the other.

    python bench/video_decode_cpu.py [--seconds 10] [--size 1280x720] [--repeats 3] [--out FILE.json]

Clips: the service benchmark's photo-like pan (encoder_service/benchmarks/video.py ``photo_clip``, x264
veryfast, 30 fps), with its sensor noise (x264 then makes P-frames: nothing to skip) and without (B-frames
between them, as most encoders' output of calm footage has). Sampled at 2 fps as the Qwen references do
(every 15th frame). Each contender's frames are checked equal to the other's.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def frame_kinds(data: bytes) -> dict[str, int]:
    import av

    kinds: dict[str, int] = {}
    with av.open(io.BytesIO(data)) as c:
        for frame in c.decode(video=0):
            name = {1: "I", 2: "P", 3: "B"}.get(int(frame.pict_type), "other")
            kinds[name] = kinds.get(name, 0) + 1
    return kinds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--size", default="1280x720")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import numpy as np

    from encoder_service.benchmarks.video import NOISE, photo_clip
    from encoder_service.preprocess import video_skip
    from encoder_service.preprocess.video_decode import VideoLimits, decode_frames

    width, height = (int(v) for v in args.size.split("x"))
    limits = VideoLimits(max_bytes=1 << 30, max_frames=100000, max_seconds=3600, max_frame_pixels=1 << 26,
                         max_decode_seconds=600)
    total = round(args.seconds * 30)
    indices = list(range(0, total, 15))
    result = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
              "clip": f"{args.seconds:g} s {width}x{height} 30 fps, {len(indices)} frames sampled", "rows": []}
    for noise in (NOISE, 0.0):
        data = photo_clip(1, args.seconds, width, height, 30, noise=noise)
        times: dict[str, list[float]] = {"every frame": [], "skipping": []}
        frames = {}
        for _ in range(args.repeats):
            for name, codecs in (("every frame", frozenset()), ("skipping", frozenset({"h264"}))):
                video_skip.CODECS = codecs
                start = time.process_time()
                frames[name] = decode_frames(data, indices, limits)
                times[name].append(time.process_time() - start)
        video_skip.CODECS = frozenset({"h264"})
        row = {"noise": noise, "bytes": len(data), "frame_kinds": frame_kinds(data),
               "equal": bool(np.array_equal(frames["every frame"], frames["skipping"])),
               **{f"{name} cpu_s": round(statistics.median(t), 3) for name, t in times.items()}}
        row["skipping / every frame"] = round(row["skipping cpu_s"] / row["every frame cpu_s"], 3)
        result["rows"].append(row)
        print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
