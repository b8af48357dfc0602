"""The service benchmark's client side (``encoder-service bench service``, see service.py): photo-like
JPEGs, client processes that drive the server at a concurrency level, and cache hits of one embedding."""

from __future__ import annotations

import io
import multiprocessing as mp
import threading
import time

import numpy as np

SHM = "shared-memory"  # the transport that has the server write into the client's shared memory
# What each transport asks of EncoderClient: "default" is a plain client (shared_memory="auto":
# shared memory where the server is on this host and writes it, else the stream).
CLIENT_SHARED_MEMORY = {"stream": False, SHM: True, "default": "auto"}


def photo_jpeg(seed: int, size: int = 1008, quality: int = 90) -> bytes:
    """A photo-like JPEG (~200 KB at 1008x1008, q90): smooth shapes, texture and sensor noise; every
    seed a different image (so a different content hash)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(photo_pixels(seed, size, size)).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def photo_pixels(seed: int, width: int, height: int) -> np.ndarray:
    """photo_jpeg's pixels (uint8, height x width x 3): also the video benchmark's frames."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    yy, xx = yy / height, xx / width
    img = np.zeros((height, width, 3), np.float32)
    for c in range(3):
        a, b, ph = rng.uniform(1, 6, 3)
        img[..., c] = 128 + 80 * np.sin(a * 6.28 * xx + ph) * np.cos(b * 6.28 * yy + c)
    for _ in range(6):  # a few soft blobs
        cx, cy, r = rng.uniform(0, 1, 3)
        mask = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (0.02 + 0.05 * r))
        img += mask[..., None] * rng.uniform(-90, 90, 3)
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


# --- clients --------------------------------------------------------------------------------------


def _client_proc(target: str, threads: int, images: list[bytes], duration_s: float, warmup: int,
                 start_at: float, out: mp.Queue, shared_memory: bool | str = False, repeat: bool = False) -> None:
    from encoder_client import EncoderClient

    client = EncoderClient(target, shared_memory=shared_memory)
    records: list[dict] = []
    lock = threading.Lock()
    cursor = [0]

    def next_image() -> bytes | None:
        with lock:
            if cursor[0] >= len(images) and not repeat:
                return None
            cursor[0] += 1
            return images[(cursor[0] - 1) % len(images)]

    def run(thread_index: int) -> None:
        for _ in range(warmup):
            img = next_image()
            if img is not None:
                client.encode([img], output_dtype="bfloat16", timeout_s=120)
        while time.time() < start_at:
            time.sleep(0.001)
        while time.time() < start_at + duration_s:
            img = next_image()
            if img is None:
                return
            t0 = time.perf_counter()
            r = client.encode([img], output_dtype="bfloat16", timeout_s=120)[0]
            rec = {"latency_ms": (time.perf_counter() - t0) * 1000, "end": time.time(), "hit": r.cache_hit,
                   "tokens": r.num_tokens, "frames": len(r.frame_indices)}  # frames: a clip's sampled ones
            rec.update(r.timing or {})
            with lock:
                records.append(rec)

    cpu: dict = {}

    def clock() -> None:  # this process's CPU over the measured window: what a client pays per image
        time.sleep(max(0.0, start_at - time.time()))
        cpu["start"] = time.process_time()
        time.sleep(max(0.0, start_at + duration_s - time.time()))
        cpu["end"] = time.process_time()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    clock_thread = threading.Thread(target=clock, daemon=True)
    clock_thread.start()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    clock_thread.join(timeout=max(0.0, start_at + duration_s - time.time()) + 1)
    client.close()
    if "end" in cpu:
        records.append({"client_cpu_seconds": cpu["end"] - cpu["start"]})
    out.put(records)


def _gen_images(seeds: list[int], q: mp.Queue, size: int = 1008) -> None:
    q.put([photo_jpeg(s, size) for s in seeds])


def make_images(count: int, first_seed: int, procs: int, size: int = 1008) -> list[bytes]:
    """``count`` photo-like JPEGs of ``size`` x ``size``, made in ``procs`` processes."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    seeds = list(range(first_seed, first_seed + count))
    parts = [seeds[i::procs] for i in range(procs)]
    return _gather([ctx.Process(target=_gen_images, args=(p, q, size)) for p in parts if p], q)


def _gather(processes: list, queue) -> list:
    """Start processes, concatenate the list each puts on queue, join them."""
    for p in processes:
        p.start()
    out = []
    for _ in processes:
        out.extend(queue.get())
    for p in processes:
        p.join()
    return out


def _window_sampler(sample, start_at: float, end_at: float, done: threading.Event) -> tuple[threading.Thread, dict]:
    """``sample()`` at ``start_at`` and at ``end_at`` (or once ``done`` is set): the server's
    counters over the measured window only, without the clients' warm-up and the drain after it."""
    taken: dict = {}

    def run() -> None:
        done.wait(max(0.0, start_at - time.time()))
        taken["before"] = sample()
        done.wait(max(0.0, end_at - time.time()))
        taken["after"] = sample()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, taken


def drive(target: str, concurrency: int, images: list[bytes], args, warmup: int, transport: str = "stream",
          sample=None) -> dict:
    """``concurrency`` clients in up to ``--client-procs`` processes for ``--seconds``; with
    ``sample``, the server's counters sampled over the measured window (``window`` in the result)."""
    ctx = mp.get_context("spawn")
    procs = max(1, min(args.client_procs, concurrency))
    per = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    share = len(images) // procs
    q = ctx.Queue()
    start_at = time.time() + args.client_start_s + 0.1 * concurrency  # after every process is up and warmed
    ps = [ctx.Process(target=_client_proc, args=(target, per[i], images[i * share:(i + 1) * share], args.seconds,
                                                 warmup, start_at, q, CLIENT_SHARED_MEMORY[transport],
                                                 args.repeat_images))
          for i in range(procs)]
    done = threading.Event()
    if sample is not None:
        sampler, window = _window_sampler(sample, start_at, start_at + args.seconds, done)
    records = _gather(ps, q)
    client_cpu = [r.pop("client_cpu_seconds") for r in records if "client_cpu_seconds" in r]
    records = [r for r in records if r]
    if sample is not None:
        done.set()  # clients that ran out of images end the window early
        sampler.join()
    if not records:
        return {"concurrency": concurrency, "transport": transport, "images": 0}
    span = max(r["end"] for r in records) - start_at
    lat = [r["latency_ms"] for r in records]
    out = {"concurrency": concurrency, "transport": transport, "images": len(records), "seconds": span,
           "images_per_s": len(records) / span, "latency_p50_ms": _pct(lat, 50),
           "latency_p99_ms": _pct(lat, 99), "cache_hits": sum(r["hit"] for r in records),
           "tokens_per_s": sum(r["tokens"] for r in records) / span}
    if any(r["frames"] for r in records):
        out["frames_per_s"] = sum(r["frames"] for r in records) / span
    for key in ("queue_ms", "preprocess_ms", "forward_ms"):
        vals = [r[key] for r in records if key in r]
        out[f"server_{key}_p50"] = _pct(vals, 50)
    in_window = sum(r["end"] <= start_at + args.seconds for r in records)
    if client_cpu and len(client_cpu) == procs and in_window:
        out["client_cpu_ms_per_image"] = 1000 * sum(client_cpu) / in_window  # every client process
    if sample is not None:
        out["window"] = window
    if len(records) < concurrency * 2:
        out["note"] = "ran out of images: raise --images-per-level"
    return out


def cache_hits(target: str, args, transport: str = "stream") -> dict:
    from encoder_client import EncoderClient

    img = photo_jpeg(10**6)
    with EncoderClient(target, shared_memory=CLIENT_SHARED_MEMORY[transport]) as client:
        client.encode([img], output_dtype="bfloat16", timeout_s=120)
        lat = []
        for _ in range(args.hit_iters):
            t0 = time.perf_counter()
            r = client.encode([img], output_dtype="bfloat16", timeout_s=60)[0]
            lat.append((time.perf_counter() - t0) * 1000)
            assert r.cache_hit
    embedding_bytes = r.nbytes  # every feature level (Qwen3-VL: main + deepstack)
    many = drive(target, 32, [img] * (32 * 400), args, warmup=1, transport=transport)
    return {"transport": transport, "embedding_bytes": embedding_bytes,
            "latency_p50_ms": _pct(lat, 50), "latency_p99_ms": _pct(lat, 99),
            "throughput_32_clients_per_s": many.get("images_per_s"),
            "latency_32_clients_p50_ms": many.get("latency_p50_ms")}
