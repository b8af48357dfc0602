"""NVDEC through the decode pool (sealed memfd answers) against PyAV through the same pool."""
import asyncio
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.getcwd())


def pick(facts):
    return list(range(0, facts.total_frames, 15))


async def main():
    from encoder_service.benchmarks.video import photo_clip
    from encoder_service.preprocess.video_decode import VideoLimits
    from encoder_service.preprocess.video_pool import VideoDecodePool

    limits = VideoLimits(max_bytes=1 << 30, max_frames=100_000, max_seconds=3600.0,
                         max_frame_pixels=1 << 26, max_decode_seconds=120.0)
    out = {}
    with VideoDecodePool(1) as cpu, VideoDecodePool(1, nvdec_gpus=(0,)) as nv:
        for w, h in ((448, 448), (1280, 720)):
            data = photo_clip(0, 4, w, h, 30)
            row = {}
            for name, pool in (("pyav", cpu), ("nvdec", nv)):
                await pool.decode(data, pick, limits)  # warm
                t = time.perf_counter()
                clip = await pool.decode(data, pick, limits)
                row[name + "_s"] = round(time.perf_counter() - t, 3)
                row[name + "_shape"] = list(clip.frames.shape)
                row[name + "_indices"] = clip.indices
                frames = row.setdefault("_frames", {})
                frames[name] = clip.frames
            frames = row.pop("_frames")
            a, b = (frames[k].astype(np.int16) for k in ("pyav", "nvdec"))
            d = np.abs(a - b)
            row["max_diff"], row["mean_diff"] = int(d.max()), round(float(d.mean()), 3)
            out[f"{w}x{h}"] = row
            print(json.dumps({f"{w}x{h}": row}), flush=True)
        print("replaced", cpu.replaced, nv.replaced)


if __name__ == "__main__":
    asyncio.run(main())
