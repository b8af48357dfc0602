"""Video through the service: clips, then images of the same token size, through ONE real server
process (the same serve flags for both halves) from client processes.

    encoder-service bench video --model qwen2.5-vl-7b --device cuda --dtype bfloat16 \
        --clip-seconds 10,30 --frame-sizes 448x448,1280x720 --concurrency 1,16 --out video.json \
        -- --max-batch-tokens 131072 --video-decode-processes 12

(A clip is one forward: Qwen2.5-VL-7B's 30 s 1280x720 clip at 2 fps is 86,400 patches, a 60 s one
172,800; the default --max-batch-tokens 16384 holds neither. The decoder processes default to 2.)

Reports, in one run:
- for each clip length x frame size (MP4/H.264 at ``--source-fps``, photo-like frames panning with
  sensor noise, so the codec does real work), sampled at ``--sample-fps``, at each ``--concurrency``:
  clips/s, frames/s (the sampled frames), embedding tokens/s, latency p50/p99 per clip, and the
  server's CPU per frame over the measured window: the server process and every descendant (the
  video decoder runs in child processes), utime+stime from /proc, reaped children included;
- images whose grid equals one temporal slice of that size's clips (an image of the clip's resized
  frame size: the tower attends within each slice, so a token costs the same in both), at the same
  levels: images/s, tokens/s, latency, the server's CPU per image;
- each clip level's tokens/s over the image tokens/s of its frame size at the same concurrency, and
  the lowest of these at the highest level (``video_to_image_tokens_ratio``; issue 33's target on one
  H100 with the CPU decode is >= 0.9).

Every request is new work: ``--distinct-clips`` clips (and as many JPEGs) are encoded per group, and
each request takes one of them made distinct by a number in an MP4 ``free`` box (a JPEG comment for
images): another content hash, so never a cache hit, with the same decode and forward work.
The options besides these are the service benchmark's (service.py), which runs this one.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import struct
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..metrics import VIDEO_STAGES
from .service_clients import drive, photo_pixels

STAGE_SECONDS = "encoder_service_video_stage_seconds"
# Sensor noise (standard deviation, of 255) added to every frame: what makes x264 (veryfast, CRF 23)
# spend about 4.4 Mbit/s on a 1280x720 30 fps clip, as a phone's or a website's 720p has.
NOISE = 8.0


def add_arguments(p) -> None:
    g = p.add_argument_group("video")
    g.add_argument("--clip-seconds", default="10,30", help="clip lengths in seconds, comma-separated")
    g.add_argument("--frame-sizes", default="448x448,1280x720", help="WIDTHxHEIGHT of the clips' frames (even)")
    g.add_argument("--sample-fps", type=float, default=2.0, help="the fps each request asks the server to sample")
    g.add_argument("--source-fps", type=int, default=30, help="the clips' own frame rate (what the decoder walks)")
    g.add_argument("--clip-noise", type=float, default=NOISE,
                   help=f"sensor noise of the clips' frames (std of 255; default {NOISE:g}: x264 then makes P-frames, "
                        "all references; 0: calm footage, mostly B-frames, whose unsampled ones the server skips)")
    g.add_argument("--clip-slices", choices=("host", "one"), default="host",
                   help="slices per frame: 'host' (x264 with PyAV's slice threads: one per core of the host "
                        "that encodes, decoded on as many threads) or 'one' (x264's default frame threads, as "
                        "the ffmpeg command line writes)")
    g.add_argument("--clips", type=int, default=100000,
                   help="most clips per length, size and level (a level also ends after --seconds)")
    g.add_argument("--distinct-clips", type=int, default=8,
                   help="clips (and JPEGs) encoded per group; requests take them in turn, each made distinct")


# --- inputs --------------------------------------------------------------------------------------


def photo_clip(seed: int, seconds: float, width: int, height: int, fps: int, noise: float = NOISE,
               one_slice: bool = False) -> bytes:
    """An MP4 (H.264, yuv420p) of photo-like frames: a slow pan over a photo_pixels image, with
    sensor noise that changes every frame (``noise``, default ``NOISE``: x264 then makes almost every
    frame a P-frame; without noise it puts B-frames between them); every seed a different clip.
    ``one_slice``: one slice a frame, as x264 writes with its default frame threads (the ffmpeg command
    line's output); otherwise x264 runs PyAV's default slice threads and cuts each frame into as many
    slices as the encoding host has cores, which a decoder then decodes on as many threads."""
    import av

    pan, jitter = max(16, width // 8), 32
    base = photo_pixels(seed, width + pan, height + pan)
    grain = np.random.default_rng(seed + 1).normal(0, noise, (height + jitter, width + jitter, 3)).astype(np.int16)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if one_slice:
            stream.thread_type = "FRAME"
        stream.options = {"preset": "veryfast", "x264-params": "log-level=error"}
        for i in range(max(1, round(seconds * fps))):
            x = int(pan * (0.5 + 0.5 * np.sin(0.7 * i / fps)))
            y = int(pan * (0.5 + 0.5 * np.cos(0.5 * i / fps)))
            dy, dx = (7 * i) % jitter, (13 * i) % jitter  # other noise every frame
            pixels = np.clip(base[y:y + height, x:x + width] + grain[dy:dy + height, dx:dx + width], 0, 255)
            pixels = pixels.astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def photo_jpeg_sized(seed: int, width: int, height: int, quality: int = 90) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(photo_pixels(seed, width, height)).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def _clip_task(task: tuple) -> tuple:
    key, seed, seconds, width, height, fps, noise, one_slice = task
    return key, photo_clip(seed, seconds, width, height, fps, noise, one_slice)


def make_clips(groups: list[tuple[float, int, int]], args) -> dict[tuple, list[bytes]]:
    """``--distinct-clips`` clips per (seconds, width, height), in spawned processes."""
    one_slice = getattr(args, "clip_slices", "host") == "one"
    tasks = [((s, w, h), 7000 + 100 * g + i, s, w, h, args.source_fps, getattr(args, "clip_noise", NOISE), one_slice)
             for g, (s, w, h) in enumerate(groups) for i in range(args.distinct_clips)]
    with mp.get_context("spawn").Pool(max(1, min(len(tasks), os.cpu_count() or 2))) as pool:
        done = pool.map(_clip_task, tasks, chunksize=1)
    clips: dict[tuple, list[bytes]] = defaultdict(list)
    for key, clip in done:
        clips[key].append(clip)
    return clips


def mp4_variant(clip: bytes, tag: int) -> bytes:
    """The clip with a trailing ``free`` box holding ``tag``: other bytes (another content hash), the
    same frames; demuxers skip free boxes."""
    return clip + struct.pack(">I4sQ", 16, b"free", tag)


def jpeg_variant(jpeg: bytes, tag: int) -> bytes:
    """The JPEG with a comment segment holding ``tag`` after its SOI: the same pixels, another hash."""
    return jpeg[:2] + b"\xff\xfe" + struct.pack(">HQ", 10, tag) + jpeg[2:]


class Distinct(Sequence):
    """``count`` inputs, ``bases`` in turn, each made distinct by ``salt`` and its index: what drive()
    hands its client processes (picklable; a slice is another Distinct, nothing is copied)."""

    def __init__(self, bases: list[bytes], count: int, salt: int, fps: float | None = None, start: int = 0):
        self.bases, self.count, self.salt, self.fps, self.start = bases, count, salt, fps, start

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self.count)
            assert step == 1
            return Distinct(self.bases, max(0, stop - start), self.salt, self.fps, self.start + start)
        if not 0 <= i < self.count:
            raise IndexError(i)
        n = self.start + i
        base, tag = self.bases[n % len(self.bases)], (self.salt << 32) + n
        if self.fps is None:
            return jpeg_variant(base, tag)
        from encoder_client import Video

        return Video(mp4_variant(base, tag), fps=self.fps)


# --- the server's side ------------------------------------------------------------------------------


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (utime+stime) of ``pid`` and every live descendant, plus what each has reaped
    (cutime+cstime: children that exited, e.g. a replaced decoder), from /proc; 0 without /proc."""
    if not os.path.isdir("/proc"):
        return 0.0
    stats: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # state, ppid, ..., utime (11) .. cstime (14)
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
    children: dict[int, list[int]] = defaultdict(list)
    for p, (ppid, _) in stats.items():
        children[ppid].append(p)
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0))[1]
        todo += children[p]
    return total / os.sysconf("SC_CLK_TCK")


def server_sample(args, pid: int) -> dict:
    """The server tree's CPU seconds and, from its /metrics, the front end's own CPU seconds, the items
    forwarded, the clips' sampled frames, the tokens by modality, and the clip stages' and queue's times."""
    out = {"t": time.time(), "cpu_seconds": tree_cpu_seconds(pid)}
    port = getattr(args, "metrics_port", None)
    if port is None:
        return out
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    # process_cpu_seconds_total: the front end's own CPU (prometheus_client's process collector, Linux),
    # without its worker and decoder processes.
    names = {"encoder_service_batch_images_sum": "items", "encoder_service_video_frames_decoded_total": "frames",
             "encoder_service_queue_seconds_sum": "queue_sum", "encoder_service_queue_seconds_count": "queue_count",
             "process_cpu_seconds_total": "front_cpu_seconds"}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = names.get(s.name)
            if s.name == "encoder_service_modality_tokens_encoded_total":
                key = f"{s.labels.get('modality')}_tokens"
            elif s.name in (f"{STAGE_SECONDS}_sum", f"{STAGE_SECONDS}_count"):
                key = f"stage_{s.labels.get('stage')}_{s.name.rsplit('_', 1)[1]}"
            if key:
                out[key] = out.get(key, 0.0) + s.value
    return out


def window_figures(window: dict, unit: str) -> dict:
    """The server's CPU over the measured window: ms per ``unit`` (frames or items) and cores busy."""
    before, after = window.get("before"), window.get("after")
    if not before or not after:
        return {}
    cpu, span = after["cpu_seconds"] - before["cpu_seconds"], after["t"] - before["t"]
    out = {"server_cpu_seconds": cpu, "server_cpu_cores": cpu / span if span > 0 else float("nan")}
    if "front_cpu_seconds" in after and span > 0:  # the front end alone: one process, one GIL
        out["front_end_cpu_cores"] = (after["front_cpu_seconds"] - before["front_cpu_seconds"]) / span
    units = after.get(unit, 0) - before.get(unit, 0)
    if units > 0:
        out[f"server_cpu_ms_per_{'frame' if unit == 'frames' else 'image'}"] = 1000 * cpu / units
    out.update(_means(before, after))
    return out


def _means(before: dict, after: dict) -> dict:
    """Over the window, the mean of each clip stage (encoder_service_video_stage_seconds) and of the
    queue wait (admission to forward), in ms: which part of a clip's time grows under load."""
    out = {}
    for name in [f"stage_{stage}" for stage in VIDEO_STAGES] + ["queue"]:
        count = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
        if count > 0:
            spent = after[f"{name}_sum"] - before[f"{name}_sum"]
            out[f"{name.removeprefix('stage_')}_mean_ms"] = 1000 * spent / count
    return out


# --- the run -----------------------------------------------------------------------------------------


def _sizes(text: str) -> list[tuple[int, int]]:
    sizes = [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s.strip()]
    if not sizes or any(len(s) != 2 or s[0] % 2 or s[1] % 2 or min(s) < 16 for s in sizes):
        raise SystemExit(f"--frame-sizes: even WIDTHxHEIGHT of at least 16, comma-separated; got {text!r}")
    return sizes


def run_video(args, result: dict, levels: list[int], transports: list[str], start_server, stop_process) -> int:
    """The run; ``start_server`` and ``stop_process`` are service.py's (which imports this module)."""
    from encoder_client import EncoderClient, Video

    groups = [(float(s), w, h) for w, h in _sizes(args.frame_sizes) for s in args.clip_seconds.split(",")]
    t0 = time.perf_counter()
    bases = make_clips(groups, args)
    result["video"] = {"sample_fps": args.sample_fps, "source_fps": args.source_fps, "codec": "h264",
                       "clip_noise": getattr(args, "clip_noise", NOISE), "distinct_clips": args.distinct_clips,
                       "clip_slices": getattr(args, "clip_slices", "host"),
                       "groups": []}
    print(f"generated {sum(len(v) for v in bases.values())} clips in {time.perf_counter() - t0:.0f} s", flush=True)
    if "--metrics-port" in args.serve_args:  # the frames and items per window come from /metrics
        args.metrics_port = int(args.serve_args[args.serve_args.index("--metrics-port") + 1])
    log_path = args.out.with_suffix(".server.log") if args.out else Path("video_bench.server.log")
    proc, target = start_server(args, log_path)
    result["video_runs"], result["image_runs"] = [], []
    salt = iter(range(1, 1 << 20))
    try:
        with EncoderClient(target) as client:
            patch = client.model_info().patch_size
            for s, w, h in groups:  # one clip each first: its grid, tokens and frames (and a warm-up)
                try:
                    r = client.encode([Video(mp4_variant(bases[s, w, h][0], 0), fps=args.sample_fps)],
                                      timeout_s=600)[0]
                except Exception as e:
                    raise RuntimeError(f"a {s:g} s {w}x{h} clip failed: {e}. A clip must fit one batch: raise "
                                       "--max-batch-tokens among the serve flags (after --)") from e
                result["video"]["groups"].append({
                    "clip_seconds": s, "width": w, "height": h, "grid_thw": list(r.grid_thw),
                    "tokens": r.num_tokens, "frames": len(r.frame_indices),
                    "clip_bytes_mean": float(np.mean([len(c) for c in bases[s, w, h]]))})
        for s, w, h in groups:
            for c in levels:
                for transport in transports:
                    clips = Distinct(bases[s, w, h], args.clips, next(salt), fps=args.sample_fps)
                    r = drive(target, c, clips, args, warmup=0, transport=transport,
                              sample=lambda: server_sample(args, proc.pid))
                    r.update(window_figures(r.pop("window", {}), "frames"))
                    r.pop("note", None)
                    r = {"clip_seconds": s, "width": w, "height": h, "clips": r.pop("images"),
                         "clips_per_s": r.pop("images_per_s", 0.0), **r}
                    print("clips:", json.dumps(r), flush=True)
                    result["video_runs"].append(r)
        # Images: one temporal slice of each frame size's clips (t, h, w in patches -> h*patch x w*patch).
        image_sizes = {}
        for g in result["video"]["groups"]:
            image_sizes.setdefault((g["width"], g["height"]), (g["grid_thw"][2] * patch, g["grid_thw"][1] * patch))
        for (w, h), (iw, ih) in image_sizes.items():
            jpegs = [photo_jpeg_sized(50000 + i, iw, ih) for i in range(args.distinct_clips)]
            for c in levels:
                for transport in transports:
                    images = Distinct(jpegs, args.images_per_level, next(salt))
                    r = drive(target, c, images, args, warmup=2, transport=transport,
                              sample=lambda: server_sample(args, proc.pid))
                    r.update(window_figures(r.pop("window", {}), "items"))
                    r.pop("note", None)
                    r = {"for_frame_size": f"{w}x{h}", "width": iw, "height": ih, **r}
                    print("images:", json.dumps(r), flush=True)
                    result["image_runs"].append(r)
    finally:
        stop_process(proc)
    ratios(result)
    print(summary(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


def ratios(result: dict) -> None:
    """Each clip level's tokens/s over its frame size's image tokens/s at the same concurrency and
    transport; ``video_to_image_tokens_ratio``: the lowest at the highest concurrency."""
    images = {(r["for_frame_size"], r["concurrency"], r["transport"]): r.get("tokens_per_s")
              for r in result["image_runs"]}
    for r in result["video_runs"]:
        image = images.get((f"{r['width']}x{r['height']}", r["concurrency"], r["transport"]))
        if image and r.get("tokens_per_s"):
            r["ratio_to_image_tokens"] = r["tokens_per_s"] / image
    top = max((r["concurrency"] for r in result["video_runs"]), default=None)
    at_top = [r["ratio_to_image_tokens"] for r in result["video_runs"]
              if r["concurrency"] == top and "ratio_to_image_tokens" in r]
    result["video_to_image_tokens_ratio"] = min(at_top) if at_top else None


def _stage_line(x: dict) -> str:
    """Where a clip's time went at this level (means over the window, when /metrics was read)."""
    parts = [f"{name} {x[f'{name}_mean_ms']:.0f}" for name in (*VIDEO_STAGES, "queue") if f"{name}_mean_ms" in x]
    return f"\n      mean ms: {', '.join(parts)}" if parts else ""


def summary(r: dict) -> str:
    nan = float("nan")
    lines = [f"{r['label'] or 'video'}: {r['model']} {r['device']} {r['dtype']} {' '.join(r['serve_args'])}"
             f" (sampled at {r['video']['sample_fps']:g} fps from {r['video']['source_fps']} fps H.264)"]
    groups = {(g["clip_seconds"], g["width"], g["height"]): g for g in r["video"]["groups"]}
    for x in r["video_runs"]:
        g = groups[x["clip_seconds"], x["width"], x["height"]]
        lines.append(
            f"  clip {x['clip_seconds']:>4g} s {x['width']:>4}x{x['height']:<4} ({g['frames']} frames, {g['tokens']} "
            f"tokens) c={x['concurrency']:>3} {x['transport']}: {x.get('clips_per_s', 0):7.2f} clips/s "
            f"{x.get('frames_per_s', 0):7.1f} frames/s {x.get('tokens_per_s', 0):9.0f} tok/s  p50 "
            f"{x.get('latency_p50_ms', nan):.0f} ms p99 {x.get('latency_p99_ms', nan):.0f} ms  server CPU "
            f"{x.get('server_cpu_ms_per_frame', nan):.1f} ms/frame ({x.get('server_cpu_cores', nan):.1f} cores, front "
            f"end {x.get('front_end_cpu_cores', nan):.2f})  x{x.get('ratio_to_image_tokens', nan):.2f} of images"
            + _stage_line(x))
    for x in r["image_runs"]:
        lines.append(
            f"  image {x['width']:>4}x{x['height']:<4} (as {x['for_frame_size']} frames) c={x['concurrency']:>3} "
            f"{x['transport']}: {x.get('images_per_s', 0):7.1f} img/s {x.get('tokens_per_s', 0):9.0f} tok/s  p50 "
            f"{x.get('latency_p50_ms', nan):.0f} ms p99 {x.get('latency_p99_ms', nan):.0f} ms  server CPU "
            f"{x.get('server_cpu_ms_per_image', nan):.1f} ms/image ({x.get('server_cpu_cores', nan):.1f} cores)")
    lines.append(f"  video tokens/s / image tokens/s at the highest concurrency (lowest group): "
                 f"{r.get('video_to_image_tokens_ratio') or nan:.2f}")
    return "\n".join(lines)
