"""Inputs for fuzzing the Encode API: a corpus of real and hostile image files, and hypothesis
strategies over every EncodeRequest field (raw protobuf, so values the client library would refuse
reach the server too)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from encoder_client.protocol import encoder_pb2 as pb
from hypothesis import strategies as st
from PIL import Image

UINT32_MAX = 2**32 - 1
PATCH_DIM = 1176  # the tiny Qwen preset's 3 * 2 * 14 * 14


def _save(img: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **kw)
    return out.getvalue()


def _rgb(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A valid PNG header claiming width x height over a few bytes of data (a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def jpeg_segments(data: bytes) -> list[tuple[int, int, int]]:
    """(marker, start, end) of each segment of a well-formed JPEG, a scan's entropy-coded data
    included in its SOS segment; up to and including EOI."""
    segments, i = [], 2
    while i + 1 < len(data):
        marker = data[i + 1]
        if marker == 0xD9:
            segments.append((marker, i, i + 2))
            break
        end = i + 2 + int.from_bytes(data[i + 2:i + 4], "big")
        if marker == 0xDA:  # the entropy-coded data runs to the next marker that is not 0xFF00 or RSTn
            end = data.index(b"\xff", end)
            while data[end + 1] == 0x00 or 0xD0 <= data[end + 1] <= 0xD7:
                end = data.index(b"\xff", end + 2)
        segments.append((marker, i, end))
        i = end
    return segments


def jpeg_scan_bomb(side: int = 256, extra_scans: int = 2000) -> bytes:
    """A valid progressive grayscale JPEG whose last scan (an AC refinement of a flat image: 12 bytes)
    is repeated ``extra_scans`` times before EOI. Each copy costs libjpeg a pass over every block of
    the image (the scan bomb of libjpeg-turbo's LJT-01-003 report): 1024x1024 with 2000 copies is
    28 KB and about 2 s of a core."""
    data = _save(Image.new("L", (side, side), 128), "JPEG", progressive=True, quality=90)
    segments = jpeg_segments(data)
    last_scan = [data[start:end] for marker, start, end in segments if marker == 0xDA][-1]
    eoi = segments[-1][1]
    return data[:eoi] + last_scan * extra_scans + data[eoi:]


def webp_canvas_bomb(side: int = 4096) -> bytes:
    """A lossless WebP of one colour: a few dozen bytes for side x side pixels. Pillow decodes WebP
    through libwebp's animation decoder, which holds two RGBA canvases, then copies the frame twice:
    about 17 bytes a pixel at the peak (8192x8192: 1.1 GB)."""
    return _save(Image.new("RGB", (side, side), (10, 20, 30)), "WEBP", lossless=True, method=0)


def png_chunk_bomb(chunks: int = 100_000) -> bytes:
    """A small PNG with ``chunks`` tiny tEXt chunks before its image data: Pillow parses each in
    Python, holding the GIL (100,000 take about 0.3 s; 64 MiB of them over 10 s)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    data = _save(_rgb(16, 16), "PNG")
    idat = data.index(b"IDAT") - 4
    return data[:idat] + chunk(b"tEXt", b"a\x00b") * chunks + data[idat:]


def animated_gif(frames: int = 300, size: int = 32) -> bytes:
    images = [_rgb(size, size, i).convert("P") for i in range(frames)]
    return _save(images[0], "GIF", save_all=True, append_images=images[1:], duration=10, loop=0)


def exif_rotated_jpeg(orientation: int, w: int = 112, h: int = 56) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _save(_rgb(w, h, orientation), "JPEG", exif=exif.tobytes())


def corpus() -> dict[str, bytes]:
    """Valid but awkward images, each of which the service must decode or refuse cleanly."""
    rgb = _rgb(96, 64)
    items = {
        "png_rgb": _save(rgb, "PNG"),
        "png_rgba": _save(rgb.convert("RGBA"), "PNG"),
        "png_palette": _save(rgb.convert("P"), "PNG"),
        "png_gray": _save(rgb.convert("L"), "PNG"),
        "png_16bit": _save(Image.fromarray(np.arange(64 * 96, dtype=np.uint16).reshape(64, 96) * 7), "PNG"),
        "png_1x1": _save(_rgb(1, 1), "PNG"),
        "png_thin": _save(_rgb(1000, 4), "PNG"),
        "jpeg_rgb": _save(rgb, "JPEG", quality=80),
        "jpeg_cmyk": _save(rgb.convert("CMYK"), "JPEG"),
        "jpeg_gray": _save(rgb.convert("L"), "JPEG"),
        "jpeg_progressive": _save(rgb, "JPEG", progressive=True),
        "gif_static": _save(rgb.convert("P"), "GIF"),
        "gif_animated": animated_gif(),
        "webp_lossy": _save(rgb, "WEBP", quality=70),
        "webp_lossless": _save(rgb, "WEBP", lossless=True),
        "png_bomb": png_bomb(),
        "png_bomb_wide": png_bomb(200_000, 2),
        "jpeg_scan_bomb": jpeg_scan_bomb(256, 2000),
        "webp_canvas_bomb": webp_canvas_bomb(1800),  # 3.2 Mpx: under 4 M pixels, not under its memory
        "png_chunk_bomb": png_chunk_bomb(2000),
        "bmp_unsupported": _save(rgb, "BMP"),
        "tiff_unsupported": _save(rgb, "TIFF"),
    }
    for orientation in range(1, 9):
        items[f"jpeg_exif_{orientation}"] = exif_rotated_jpeg(orientation)
    return items


CORPUS = corpus()


@st.composite
def mutated_image(draw) -> bytes:
    """A corpus file, as is or truncated, with bytes flipped, or with a piece of another spliced in."""
    data = bytearray(CORPUS[draw(st.sampled_from(sorted(CORPUS)))])
    how = draw(st.sampled_from(["as_is", "truncate", "flip", "splice", "header_only"]))
    if how == "truncate":
        data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
    elif how == "flip":
        for _ in range(draw(st.integers(1, 16))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
    elif how == "splice":
        other = CORPUS[draw(st.sampled_from(sorted(CORPUS)))]
        cut = draw(st.integers(0, len(data)))
        data = data[:cut] + other[draw(st.integers(0, len(other))):]
    elif how == "header_only":
        data = data[:64]
    return bytes(data)


def _patches_data(grid: list[int], dtype: int, draw) -> bytes:
    """Bytes for a patches image: exactly the grid's size when that is small, else some length."""
    itemsize = {pb.DTYPE_FLOAT32: 4, pb.DTYPE_FLOAT16: 2, pb.DTYPE_BFLOAT16: 2, pb.DTYPE_UINT8: 1}.get(dtype, 4)
    n = int(np.prod(grid)) if len(grid) == 3 else 0
    if 0 < n <= 256 and draw(st.booleans()):
        size = n * PATCH_DIM * itemsize + draw(st.sampled_from([0, 0, 0, 1, -1, itemsize]))
    else:
        size = draw(st.integers(0, 4096))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if dtype == pb.DTYPE_FLOAT32 and size % 4 == 0 and draw(st.booleans()):
        specials = np.array([np.nan, np.inf, -np.inf, 1e38, -0.0], np.float32)
        values = rng.standard_normal(size // 4).astype(np.float32)
        if len(values):
            values[rng.integers(0, len(values), 4)] = rng.choice(specials, 4)
        return values.tobytes()[:size]
    return rng.integers(0, 256, max(0, size), dtype=np.uint8).tobytes()


uint32s = st.one_of(st.integers(0, 64), st.sampled_from([0, 1, 2, 3, 4, 28, 1024, 65535, 2**31, UINT32_MAX]),
                    st.integers(0, UINT32_MAX))
dtype_enums = st.one_of(st.sampled_from([0, 1, 2, 3, 4]), st.integers(5, 1000), st.integers(-(2**31), -1),
                        st.just(2**31 - 1))
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=300)
# Targets near the allowlist's edges (the fuzzed server allows 127.0.0.1:*): port 1 has no listener.
sink_targets = st.one_of(
    st.sampled_from(["127.0.0.1:1", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.01:1",
                     "127.0.0.1.:1", "127.1:1", "0x7f.0.0.1:1", "[::1]:1", "[::ffff:127.0.0.1]:1", "localhost:1",
                     "dns:///127.0.0.1:1", "unix:/tmp/x", "127.0.0.1:1/x", "127.0.0.1", ":1", "127.0.0.1:1:1",
                     "127.0.0.1:001", " 127.0.0.1:1", "127.0.0.1:1\n", "127.0.0.0x1:1", "0x7f000001:1",
                     "0177.1:1", "127.0.0.1:\u00b2", "127.0.0.1:\uff11", "x\n.y:1"]),
    st.builds(lambda a, port: f"127.0.0.{a}:{port}", st.integers(0, 999), st.integers(0, 99999)))


_VIDEO_CORPUS: dict[str, bytes] = {}


def video_corpus() -> dict[str, bytes]:
    """The broken and awkward clips of video_inputs.py, made once (encoding them takes a second)."""
    if not _VIDEO_CORPUS:
        from .video_inputs import video_corpus as make

        _VIDEO_CORPUS.update(make())
    return _VIDEO_CORPUS


@st.composite
def videos(draw) -> pb.Video:
    """A clip from the video corpus (or random bytes, or frames from the image corpus) with any sampling."""
    sampling = pb.VideoSampling(
        reference=draw(st.sampled_from(["", "transformers", "vllm", "opencv"])),
        fps=draw(st.sampled_from([0.0, 0.5, 2.0, 30.0, 1e9, float("nan"), -1.0])),
        num_frames=draw(st.sampled_from([0, 0, 1, 2, 3, 4, 1000, UINT32_MAX])),
        min_frames=draw(st.sampled_from([0, 0, 1, 8])), max_frames=draw(st.sampled_from([0, 0, 2, 768])),
        max_pixels=draw(st.sampled_from([0, 0, 1, 28 * 28 * 4, 2**40])),
        processor_fps=draw(st.sampled_from([0.0, 0.0, 1.0, 30.0, float("nan"), -1.0])),
        processor_num_frames=draw(st.sampled_from([0, 0, 1, 8, UINT32_MAX])))
    do_sample = draw(st.sampled_from([None, None, True, False]))
    if do_sample is not None:
        sampling.processor_do_sample_frames = do_sample
    how = draw(st.sampled_from(["corpus", "corpus", "frames", "random"]))
    if how == "frames":
        frames = draw(st.lists(st.sampled_from(sorted(CORPUS)), min_size=0, max_size=4))
        return pb.Video(frames=[CORPUS[f] for f in frames], sampling=sampling,
                        frames_fps=draw(st.sampled_from([0.0, 1.0, 30.0, float("inf")])))
    if how == "random":
        return pb.Video(encoded=draw(st.binary(max_size=2048)), sampling=sampling)
    clips = video_corpus()
    return pb.Video(encoded=clips[draw(st.sampled_from(sorted(clips)))], sampling=sampling)


@st.composite
def images(draw) -> pb.Image:
    kind = draw(st.sampled_from(["encoded", "encoded", "patches", "patches", "content_hash", "none", "random",
                                 "video"]))
    if kind == "video":
        return pb.Image(video=draw(videos()))
    if kind == "encoded":
        return pb.Image(encoded=draw(mutated_image()))
    if kind == "random":
        return pb.Image(encoded=draw(st.binary(max_size=2048)))
    if kind == "patches":
        grid = draw(st.one_of(st.lists(st.sampled_from([1, 2, 4, 6, 8, 16]), min_size=3, max_size=3),
                              st.lists(uint32s, max_size=5)))
        dtype = draw(dtype_enums)
        return pb.Image(patches=pb.Patches(grid_thw=grid, dtype=dtype, data=_patches_data(grid, dtype, draw)))
    if kind == "content_hash":
        return pb.Image(content_hash=draw(st.one_of(texts, st.text("0123456789abcdef", min_size=64, max_size=64))))
    return pb.Image()


@st.composite
def encode_requests(draw) -> pb.EncodeRequest:
    request = pb.EncodeRequest(
        request_id=draw(st.one_of(st.just(""), texts, st.just("r" * 256), st.just("x" * 257),
                                  st.just("\U0001F600" * 300))),
        images=draw(st.lists(images(), max_size=5)),
        output_dtype=draw(dtype_enums),
        max_chunk_bytes=draw(uint32s),
    )
    if draw(st.booleans()):
        request.sink.target = draw(st.one_of(texts, sink_targets))
        request.sink.request_id = draw(texts)
    return request
