"""Video inputs for tests and fuzzing: small clips generated with PyAV (no files in the repository),
broken and hostile variants of them, and faults to inject into a video decode process.

What the av 18.1.0 wheel encodes (and decodes): MP4/MOV with mpeg4, libx264 (H.264), libx265
(H.265), libsvtav1 (AV1, MP4 only), libvpx-vp9 (VP9, MP4 only); Matroska with all of those and
libvpx (VP8); WebM with VP8, VP9 and AV1. MJPEG encodes too (a codec the service refuses). AV1
decodes with libdav1d. Matroska and WebM headers state no frame count (PyAV reports 0 frames).
"""

from __future__ import annotations

import contextlib
import ctypes
import fractions
import functools
import io
import os
import struct
import time

import numpy as np

# (container, encoder) pairs that round-trip through the av wheel; the decoder's canonical name third.
CLIP_KINDS: tuple[tuple[str, str, str], ...] = (
    ("mp4", "mpeg4", "mpeg4"),
    ("mp4", "libx264", "h264"),
    ("mov", "libx264", "h264"),
    ("mp4", "libx265", "hevc"),
    ("mp4", "libvpx-vp9", "vp9"),
    ("mp4", "libsvtav1", "av1"),
    ("matroska", "libx264", "h264"),
    ("matroska", "libx265", "hevc"),
    ("webm", "libvpx", "vp8"),
    ("webm", "libvpx-vp9", "vp9"),
    ("webm", "libsvtav1", "av1"),
    ("avi", "mpeg4", "mpeg4"),
    ("avi", "mjpeg", "mjpeg"),  # make_clip gives it the full-range yuvj420p it needs
)


def frame_pattern(i: int, width: int, height: int) -> np.ndarray:
    """Frame i of a generated clip: every frame different, with edges and flat areas."""
    img = np.zeros((height, width, 3), np.uint8)
    img[..., 0] = (i * 20) % 256
    img[:, : (i * 5) % width, 1] = 200
    img[height // 2:, :, 2] = (50 + 7 * i) % 256
    img[(i * 3) % height, :, :] = 255
    return img


def moving_gradient(i: int, width: int, height: int) -> np.ndarray:
    """Frame i of a smooth pan: what encoders give B-frames (frame_pattern's jumps get P- and I-frames)."""
    yy, xx = np.mgrid[0:height, 0:width]
    return np.stack([(xx + 4 * i) % 256, (yy + 2 * i) % 256, ((xx + yy) // 2 + i) % 256], -1).astype(np.uint8)


def make_clip(container: str = "mp4", codec: str = "libx264", frames: int = 12, width: int = 64, height: int = 48,
              fps: int = 10, pix_fmt: str = "yuv420p", sizes: list[tuple[int, int]] | None = None,
              options: dict[str, str] | None = None, first_pts: int = 0, pattern=frame_pattern) -> bytes:
    """A clip of ``frames`` generated frames, encoded in memory. ``sizes``: a (width, height) per
    frame, for encoders that take a size change mid-stream. ``options``: the encoder's (``{"bf": "3"}``:
    B-frames). ``first_pts`` < 0: MP4 keeps the frames before pts 0 as an edit list's pre-roll, which
    demuxes as packets FFmpeg discards. ``pattern``: frame i's pixels (frame_pattern, moving_gradient)."""
    with _scheduling_kept():
        return _encode_clip(container, codec, frames, width, height, fps, pix_fmt, sizes, options, first_pts, pattern)


@contextlib.contextmanager
def _scheduling_kept():
    """The calling thread's scheduling policy, put back after the block. SVT-AV1's encoder, run as root,
    switches the thread that opens it to SCHED_FIFO at priority 99: a test process that made an AV1
    clip then ran every later test (and every server it started, which inherits the policy) at
    real-time priority, and starved the other pytest worker on a 2-core machine into timeouts. Only
    encoding does this (the service decodes AV1 with dav1d and never encodes). Kept around every
    encode, whichever encoder: two syscalls, and no list of encoders that do it to keep up to date."""
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        yield
    finally:
        if (os.sched_getscheduler(0), os.sched_getparam(0)) != (policy, param):
            os.sched_setscheduler(0, policy, param)


def _encode_clip(container, codec, frames, width, height, fps, pix_fmt, sizes, options, first_pts, pattern) -> bytes:
    import av

    if codec == "mjpeg" and pix_fmt == "yuv420p":
        pix_fmt = "yuvj420p"  # FFmpeg's MJPEG encoder takes full-range YUV only
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        if codec.startswith("libx26"):  # quiet, and no encoder threads on a shared CI machine
            stream.options = {"x264-params" if codec == "libx264" else "x265-params": "log-level=error"}
        stream.options = {**stream.options, **(options or {})}
        for i in range(frames):
            w, h = sizes[i] if sizes else (width, height)
            frame = av.VideoFrame.from_ndarray(pattern(i, w, h), format="rgb24")
            if first_pts:
                frame.pts = first_pts + i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def vp8_size_bomb(width: int = 12000, height: int = 12000, frames: int = 3) -> bytes:
    """A WebM whose container header says 64x48 but whose first VP8 key frame claims width x
    height: the header passes, the decoder would allocate the frame (12000x12000: about 260 MB)."""
    data = bytearray(make_clip("webm", "libvpx", frames=frames))
    at = data.find(b"\x9d\x01\x2a")  # a VP8 key frame's start code; 14-bit width and height follow
    data[at + 3:at + 7] = struct.pack("<HH", width, height)
    return bytes(data)


@functools.lru_cache(maxsize=4)
def _static_vp9_packets(width: int, height: int, fps: int) -> tuple[bytes, bytes]:
    """(a key frame, an inter frame that changes nothing) of one picture, as libvpx-vp9 encodes them."""
    import av

    packets: list[bytes] = []
    with av.open(io.BytesIO(), "w", format="webm") as scratch:
        stream = scratch.add_stream("libvpx-vp9", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"deadline": "realtime", "cpu-used": "8", "crf": "63", "b": "0",
                          "g": str(1 << 20), "lag-in-frames": "0", "threads": "1"}
        picture = av.VideoFrame.from_ndarray(frame_pattern(0, width, height), format="rgb24")
        for i in range(3):
            picture.pts = i
            packets += [bytes(p) for p in stream.encode(picture)]
        packets += [bytes(p) for p in stream.encode()]
    if len(packets) < 2:
        raise RuntimeError(f"libvpx-vp9 gave {len(packets)} packets for 3 frames")
    return packets[0], packets[-1]


@functools.lru_cache(maxsize=64)
def decode_bomb(width: int = 1792, height: int = 1792, frames: int = 18000, fps: int = 30) -> bytes:
    """The audit's decode bomb: VP9 in WebM, one key frame of width x height, then ``frames - 1``
    empty inter frames (the same static picture; about 45 bytes each), so well under 1 MB takes the
    decoder through ``frames`` full-size frames (1792x1792 is the tiny preset's --max-image-pixels
    exactly; the default 18000 frames at 30 fps is --max-video-frames and --max-video-seconds
    exactly). Sampled with num_frames=2, the second sampled frame lies half the stream away:
    thousands of frames decoded for two used.

    Encoding thousands of 1792x1792 frames takes minutes, so libvpx-vp9 encodes three frames of one
    picture (realtime, crf 63, no key frame after the first) and the last inter frame's packet, a
    frame that changes nothing, is muxed again for every later frame with its own timestamp; the
    decoder decodes each one as the encoder wrote it. ``frames`` (or ``fps``) apart, two bombs are
    different bytes (different cache entries and jobs). Cached: about 1.5 s for the first bomb of a
    size (the encoding), then a fraction of a second for each frame count."""
    import av

    key, empty = _static_vp9_packets(width, height, fps)
    out = io.BytesIO()
    time_base = fractions.Fraction(1, fps)
    with av.open(out, "w", format="webm") as container:
        stream = container.add_stream("libvpx-vp9", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            packet = av.Packet(key if i == 0 else empty)
            packet.pts = packet.dts = i
            packet.time_base = time_base
            packet.stream = stream
            packet.is_keyframe = i == 0
            container.mux(packet)
    return out.getvalue()


@functools.lru_cache(maxsize=8)
def big_png(side: int = 1380, rgba: bool = True, seed: int = 0) -> bytes:
    """A side x side PNG (RGBA or RGB) that costs its full size to decode and resize: a gradient with
    random pixels scattered over it (0.2% of them, every channel random), which PNG's filters cannot
    predict. Not noise everywhere: a 1380x1380 RGBA of pure noise is 7.6 MB, and the audit's request
    of 2 clips x 180 such frames must fit one --max-message-bytes (64 MiB): this one is about 150 KB,
    while decoding still inflates and unfilters every one of its 1.9 M pixels, and resizing reads them
    all. Cached."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = 4 if rgba else 3
    yy, xx = np.mgrid[0:side, 0:side]
    planes = [xx * 255 // side, yy * 255 // side, (xx + yy) * 255 // (2 * side)]
    if rgba:
        planes.append(255 - (xx * 64 // side))
    pixels = np.stack(planes, -1).astype(np.uint8)
    noisy = rng.random((side, side)) < 0.002
    pixels[noisy] = rng.integers(0, 256, (int(noisy.sum()), channels), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGBA" if rgba else "RGB").save(out, "PNG", compress_level=9)
    return out.getvalue()


@functools.lru_cache(maxsize=1)
def tiny_gif() -> bytes:
    """A 1x1 GIF (a few dozen bytes): a frame that costs nothing to send, whatever the server makes of it."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("P", (1, 1), 0).save(out, "GIF")
    return out.getvalue()


def matroska_without_frames() -> bytes:
    """A Matroska file whose header and video track are intact and whose clusters are all cut off."""
    data = make_clip("matroska", "libx264")
    return data[: data.index(b"\x1f\x43\xb6\x75")]  # the first Cluster element


def video_corpus() -> dict[str, bytes]:
    """Valid, awkward and broken clips: the service must decode each or refuse it cleanly."""
    good = make_clip("mp4", "libx264")
    webm = make_clip("webm", "libvpx-vp9")
    items = {
        "mp4_h264": good,
        "mov_h264": make_clip("mov", "libx264"),
        "mkv_h264": make_clip("matroska", "libx264"),
        "webm_vp9": webm,
        "webm_vp8": make_clip("webm", "libvpx"),
        "mp4_mpeg4_one_frame": make_clip("mp4", "mpeg4", frames=1),
        "mov_png_unsupported": make_clip("mov", "png", pix_fmt="rgb24"),
        "mkv_no_frames": matroska_without_frames(),
        "webm_vp8_size_bomb": vp8_size_bomb(),
        "mp4_truncated_half": good[: len(good) // 2],
        "mp4_header_only": good[:64],
        "webm_truncated": webm[: len(webm) * 2 // 3],
        "random_bytes": np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "png_not_a_video": b"\x89PNG\r\n\x1a\n" + b"\x00" * 64,
    }
    rng = np.random.default_rng(1)
    for name in ("mp4_h264", "webm_vp9"):
        flipped = bytearray(items[name])
        for at in rng.integers(0, len(flipped), 24):
            flipped[at] ^= 1 << int(rng.integers(0, 8))
        items[f"{name}_bit_flipped"] = bytes(flipped)
    return items


# --- faults for a video decode process (picklable: module-level, they run in the child) ------------

def every_frame(facts) -> list[int]:
    """Every frame of the clip (a decode that walks the whole stream)."""
    return list(range(facts.total_frames))


def every_nth_frame(facts, n: int) -> list[int]:
    """Frames 0, n, 2n, ... (as a 2 fps sample of a 30 fps clip takes every 15th)."""
    return list(range(0, facts.total_frames, n))


def first_frame(facts) -> list[int]:
    """An indices_fn: frame 0."""
    return [0]


def first_frame_once_imported(facts, module: str) -> list[int]:
    """An indices_fn (a ``functools.partial`` naming ``module``): frame 0 where the decoder process had
    already imported ``module`` before this call, else InvalidInput saying so."""
    import sys

    from encoder_service.errors import InvalidInput

    if module not in sys.modules:
        raise InvalidInput(f"{module} was not imported in the decoder process")
    return [0]


def abort_process(facts) -> list[int]:
    """An indices_fn that aborts its process (SIGABRT), as a C library's failed assertion does."""
    os.abort()


def segfault_process(facts) -> list[int]:
    """An indices_fn that reads address 0 (SIGSEGV), as a decoder's bad pointer does."""
    ctypes.string_at(0)
    return [0]


def hang_process(facts, seconds: float = 3600.0) -> list[int]:
    """An indices_fn that never answers in time, as a decoder stuck in a loop does."""
    time.sleep(seconds)
    return [0]


# --- a decode process taken over by a clip: it answers the server with whatever it likes ----------
# Each writes its answer straight to the socket the child shares with the server (framed as
# decoder_channel.py frames: an 8-byte length, then the body), then waits to be killed.

def _to_server(body: bytes, fd: int | None = None, announce: int | None = None) -> None:
    import array
    import socket

    for name in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                break
        except OSError:
            continue
    sock = socket.socket(fileno=os.dup(int(name)))
    header = struct.pack("!Q", len(body) if announce is None else announce)
    fds = [] if fd is None else [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
    sock.sendmsg([header + body], fds)
    time.sleep(3600)


class _RunsCode:
    """Unpickling this calls os.system: what a hostile pickle does."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def answer_with_a_pickle(facts, marker: str) -> list[int]:
    """Answers with a pickle that, unpickled, creates ``marker``."""
    import pickle

    _to_server(pickle.dumps(("ok", _RunsCode(f"touch {marker}"))))
    return [0]


def answer_and_stall(facts) -> list[int]:
    """Announces a 1000-byte answer, sends 10 bytes of it, and stalls."""
    _to_server(b"{" * 10, announce=1000)
    return [0]


def answer_too_long(facts) -> list[int]:
    """Announces an answer of 1 GiB."""
    _to_server(b"{}", announce=1 << 30)
    return [0]


def _ok(shape: list[int], total: int = 12) -> bytes:
    import json

    return json.dumps({"status": "ok", "indices": list(range(shape[0])), "shape": shape,
                       "facts": {"total_frames": total, "fps": 24.0, "duration_s": 0.5}}).encode()


def frames_in_an_unsealed_memfd(facts) -> list[int]:
    """Frames in a memfd it could still shrink under the server's mapping (a SIGBUS there)."""
    fd = os.memfd_create("clip-frames", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 48 * 64 * 3)
    _to_server(_ok([1, 48, 64, 3]), fd)
    return [0]


def frames_in_a_file(facts, path: str) -> list[int]:
    """Frames in an ordinary file (which anyone who can open it could change)."""
    with open(path, "wb") as f:
        f.write(bytes(48 * 64 * 3))
    fd = os.open(path, os.O_RDONLY)
    _to_server(_ok([1, 48, 64, 3]), fd)
    return [0]


def frames_of_the_wrong_size(facts) -> list[int]:
    """A sealed memfd smaller than the frames it announces."""
    import fcntl

    fd = os.memfd_create("clip-frames", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 100)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    _to_server(_ok([1, 48, 64, 3]), fd)
    return [0]


def frames_over_the_limits(facts) -> list[int]:
    """Announces a frame larger than --max-image-pixels allows."""
    _to_server(_ok([1, 100000, 100000, 3]))
    return [0]


def frames_without_their_memfd(facts) -> list[int]:
    """Announces frames and sends no descriptor."""
    _to_server(_ok([1, 48, 64, 3]))
    return [0]


def allocate(facts, nbytes: int = 8 << 30) -> list[int]:
    """An indices_fn that asks for ``nbytes`` of private memory (not touched: no page is used), as a
    decoder bug that sizes a buffer from corrupt data does."""
    buffer = np.empty(nbytes, np.uint8)
    del buffer
    return [0]


def answer_deeply_nested(facts) -> list[int]:
    """An answer nested past the JSON parser's recursion limit, with a memfd beside it."""
    _to_server(b"[" * 60000, os.memfd_create("clip-frames"))
    return [0]


def answer_nan_fps(facts) -> list[int]:
    """Facts with an fps of NaN (which Python's json writes and reads by default)."""
    _to_server(_ok([1, 48, 64, 3]).replace(b'"fps": 24.0', b'"fps": NaN'))
    return [0]
