"""Qwen2-VL preprocessing: parity with transformers' Pillow processor, and every decode error."""

from __future__ import annotations

import io
import json
import struct
import time
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile, ImageOps
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as qwen2_vl_pil

from encoder_service.errors import InvalidInput, ResourceExhausted
from encoder_service.models.qwen2_5_vl.preprocess import Qwen2VLPreprocessConfig, preprocess_qwen2_vl, smart_resize
from encoder_service.preprocess import decode_image
from encoder_service.preprocess.decode import DECODE_BYTES_PER_LIMIT_PIXEL

TOLERANCE = 1e-5


# ---------------------------------------------------------------------------------------------
# helpers


def random_pixels(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, channels), dtype=np.uint8)


def encode(image: Image.Image, fmt: str, **save_kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


def rgb_image(height: int, width: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(random_pixels(height, width, 3, seed), mode="RGB")


def reference(data: bytes, config: dict, exif_transpose: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """transformers' answer for the same bytes: PIL.Image.open -> Qwen2VLImageProcessorPil."""
    processor = qwen2_vl_pil.Qwen2VLImageProcessorPil(**config)
    image = Image.open(io.BytesIO(data))
    if exif_transpose:
        image = ImageOps.exif_transpose(image)
    out = processor(images=image)
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def assert_matches_transformers(data: bytes, config: dict | None = None, exif_transpose: bool = False):
    config = config or {}
    pixels, grid = preprocess_qwen2_vl(data, Qwen2VLPreprocessConfig.from_dict(config))
    ref_pixels, ref_grid = reference(data, config, exif_transpose)
    assert grid == tuple(int(v) for v in ref_grid[0])
    assert all(type(v) is int for v in grid)
    assert pixels.dtype == np.float32 and pixels.flags.c_contiguous
    assert pixels.shape == ref_pixels.shape
    assert np.abs(pixels - ref_pixels).max() <= TOLERANCE
    return pixels, grid


def png_with_header_size(width: int, height: int) -> bytes:
    """A valid tiny PNG whose IHDR (CRC fixed up) claims width x height: pixels would take GBs."""
    data = bytearray(encode(rgb_image(4, 4), "PNG"))
    ihdr = data.index(b"IHDR")  # length(4) 'IHDR' width(4) height(4) ...
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr : ihdr + 4 + 13]))
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", crc)
    return bytes(data)


# ---------------------------------------------------------------------------------------------
# parity: sizes and configs


@pytest.mark.parametrize(
    ("height", "width"),
    [
        (224, 224),  # exact multiples of 28
        (300, 451),  # non-square, sides not multiples of 28
        (451, 300),
        (70, 98),  # 70/28 = 2.5: round-half-to-even territory
        (42, 126),  # 1.5 and 4.5
        (1, 200),  # aspect ratio exactly at the limit: accepted, upscaled
        (13, 17),  # tiny: upscaled by min_pixels
    ],
)
def test_rgb_png_sizes_match_transformers(height: int, width: int):
    assert_matches_transformers(encode(rgb_image(height, width, seed=height * width), "PNG"))


def test_large_image_downscaled_by_max_pixels_matches_transformers():
    data = encode(rgb_image(1100, 1500, seed=7), "JPEG", quality=90)
    _, grid = assert_matches_transformers(data)
    assert grid[1] * grid[2] * 14 * 14 <= 28 * 28 * 1280  # really was bounded by max_pixels


def test_tiny_image_upscaled_by_min_pixels_matches_transformers():
    config = {"min_pixels": 256 * 28 * 28, "max_pixels": 512 * 28 * 28}
    _, grid = assert_matches_transformers(encode(rgb_image(40, 60, seed=3), "PNG"), config)
    assert grid[1] * grid[2] * 14 * 14 >= 256 * 28 * 28


def test_downscale_with_small_max_pixels_matches_transformers():
    config = {"size": {"shortest_edge": 3136, "longest_edge": 64 * 28 * 28}}
    _, grid = assert_matches_transformers(encode(rgb_image(500, 700, seed=4), "PNG"), config)
    assert grid[1] * grid[2] <= 4 * 64


@pytest.mark.parametrize(
    "config",
    [
        {"min_pixels": 3136, "max_pixels": 200 * 28 * 28},  # old keys
        {"size": {"shortest_edge": 3136, "longest_edge": 200 * 28 * 28}},  # new keys
        {"do_normalize": False},
        {"do_rescale": False},
        {"do_rescale": False, "do_normalize": False},
        {"resample": int(Image.Resampling.BILINEAR)},
        {"rescale_factor": 1 / 127.5, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
        {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2},  # Qwen3-VL-like geometry
        {"patch_size": 14, "merge_size": 1, "temporal_patch_size": 1},
    ],
    ids=lambda c: json.dumps(c, sort_keys=True),
)
def test_config_variants_match_transformers(config: dict):
    assert_matches_transformers(encode(rgb_image(123, 321, seed=11), "PNG"), config)


# ---------------------------------------------------------------------------------------------
# parity: pixel formats and containers


def test_png_with_alpha_matches_transformers():
    rgba = random_pixels(90, 130, 4, seed=1)
    rgba[:30, :, 3] = 0  # fully transparent rows: transformers composites them onto white
    pixels, _ = assert_matches_transformers(encode(Image.fromarray(rgba, mode="RGBA"), "PNG"))
    # ...which is not what Pillow's convert("RGB") (drop alpha) would give.
    naive = Image.fromarray(rgba, mode="RGBA").convert("RGB")
    naive_pixels, _ = preprocess_qwen2_vl(encode(naive, "PNG"), Qwen2VLPreprocessConfig())
    assert np.abs(pixels - naive_pixels).max() > 0.1


def test_grayscale_alpha_png_matches_transformers():
    la = random_pixels(77, 66, 2, seed=2)
    assert_matches_transformers(encode(Image.fromarray(la, mode="LA"), "PNG"))


def test_grayscale_png_matches_transformers():
    gray = random_pixels(100, 80, 1, seed=3)[..., 0]
    assert_matches_transformers(encode(Image.fromarray(gray, mode="L"), "PNG"))


def test_bilevel_png_matches_transformers():
    bits = random_pixels(64, 96, 1, seed=4)[..., 0] > 127
    assert_matches_transformers(encode(Image.fromarray(bits), "PNG"))


def test_16_bit_grayscale_png_matches_transformers():
    deep = np.random.default_rng(5).integers(0, 65536, size=(60, 90), dtype=np.uint16)
    image = Image.fromarray(deep)
    assert_matches_transformers(encode(image, "PNG"))


def test_palette_png_matches_transformers():
    palette_image = rgb_image(96, 120, seed=6).quantize(colors=64)
    assert palette_image.mode == "P"
    assert_matches_transformers(encode(palette_image, "PNG"))


def test_palette_png_with_transparent_index_matches_transformers():
    palette_image = rgb_image(96, 120, seed=7).quantize(colors=32)
    data = encode(palette_image, "PNG", transparency=5)
    assert Image.open(io.BytesIO(data)).info.get("transparency") is not None
    assert_matches_transformers(data)


def test_rgb_png_with_colour_key_matches_transformers():
    # tRNS on an RGB PNG: transformers treats it as alpha (key colour -> white).
    pixels = random_pixels(50, 70, 3, seed=8)
    pixels[:10] = (10, 20, 30)
    data = encode(Image.fromarray(pixels, mode="RGB"), "PNG", transparency=(10, 20, 30))
    assert_matches_transformers(data)


def test_cmyk_jpeg_matches_transformers():
    cmyk = Image.fromarray(random_pixels(88, 120, 4, seed=9), mode="CMYK")
    data = encode(cmyk, "JPEG", quality=90)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    assert_matches_transformers(data)


def test_rgb_jpeg_matches_transformers():
    assert_matches_transformers(encode(rgb_image(333, 222, seed=10), "JPEG", quality=85))


def test_webp_matches_transformers():
    assert_matches_transformers(encode(rgb_image(140, 200, seed=12), "WEBP", quality=80))


def test_webp_with_alpha_matches_transformers():
    rgba = Image.fromarray(random_pixels(64, 64, 4, seed=13), mode="RGBA")
    assert_matches_transformers(encode(rgba, "WEBP", lossless=True))


def test_gif_first_frame_matches_transformers():
    frames = [rgb_image(72, 100, seed=s).quantize(colors=16) for s in (14, 15)]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    pixels, _ = assert_matches_transformers(data)
    second = Image.open(io.BytesIO(data))
    second.seek(1)
    second_pixels, _ = preprocess_qwen2_vl(encode(second.convert("RGB"), "PNG"), Qwen2VLPreprocessConfig())
    assert np.abs(pixels - second_pixels).max() > 0.1  # it really was the first frame


def test_jpeg_exif_orientation_is_applied_and_matches_transformers_on_the_oriented_image():
    # transformers' processor ignores EXIF; its load_image (and vLLM) apply it, and so do we.
    # Parity is therefore against the processor fed ImageOps.exif_transpose(Image.open(...)).
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    data = encode(rgb_image(60, 150, seed=16), "JPEG", quality=90, exif=exif)
    _, grid = assert_matches_transformers(data, exif_transpose=True)
    _, raw_grid = reference(data, {})
    assert (grid[1], grid[2]) == (int(raw_grid[0][2]), int(raw_grid[0][1]))  # tall, not wide
    assert decode_image(data, None).size == (60, 150)


@pytest.mark.parametrize("mode", ["P", "RGBA", "L"])
def test_png_exif_orientation_keeps_palette_and_alpha_handling(mode: str):
    # Orientation is applied in place on the decoded image; palette and transparency must survive.
    image = rgb_image(50, 90, seed=19)
    image = image.quantize(colors=16) if mode == "P" else image.convert(mode)
    exif = Image.Exif()
    exif[0x0112] = 8
    extra = {"transparency": 3} if mode == "P" else {}
    data = encode(image, "PNG", exif=exif, **extra)
    _, grid = assert_matches_transformers(data, exif_transpose=True)
    assert grid == (1, 6, 4)


# ---------------------------------------------------------------------------------------------
# decode_image


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "CMYK"])
def test_decode_image_always_returns_rgb(mode: str):
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    image = rgb_image(20, 30).convert(mode)
    decoded = decode_image(encode(image, fmt), max_image_pixels=10_000)
    assert decoded.mode == "RGB" and decoded.size == (30, 20)


def test_empty_bytes_are_invalid():
    with pytest.raises(InvalidInput, match="empty"):
        decode_image(b"", None)


def test_garbage_bytes_are_not_a_decodable_image():
    with pytest.raises(InvalidInput, match="not a decodable image"):
        decode_image(b"this is not an image, honest" * 10, None)


def test_unsupported_format_is_not_a_decodable_image():
    with pytest.raises(InvalidInput, match="not a decodable image"):
        decode_image(encode(rgb_image(8, 8), "BMP"), None)


def test_damaged_png_header_is_not_a_decodable_image():
    data = bytearray(encode(rgb_image(8, 8), "PNG"))
    data[20] ^= 0xFF  # inside IHDR: CRC mismatch
    with pytest.raises(InvalidInput, match="not a decodable image"):
        decode_image(bytes(data), None)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF"])
def test_truncated_image_is_invalid_and_says_truncated(fmt: str):
    image = rgb_image(64, 64, seed=17)
    if fmt == "GIF":
        image = image.quantize(colors=64)
    data = encode(image, fmt)
    with pytest.raises(InvalidInput, match="truncated"):
        decode_image(data[: len(data) * 2 // 3], None)


def test_load_truncated_images_flag_is_off_and_refused_if_turned_on(monkeypatch):
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        decode_image(encode(rgb_image(8, 8), "PNG"), None)


def test_pixel_limit_is_checked_from_the_header_before_decoding():
    # 5000 x 5000 claimed, 4 x 4 of real data: decoding would fail as truncated, so a
    # ResourceExhausted (not InvalidInput) proves the pixels were never decoded.
    data = png_with_header_size(5000, 5000)
    start = time.perf_counter()
    with pytest.raises(ResourceExhausted) as excinfo:
        decode_image(data, max_image_pixels=1_000_000)
    assert time.perf_counter() - start < 5.0  # generous for a loaded CI machine; ResourceExhausted is the proof
    assert "25000000" in str(excinfo.value) and "1000000" in str(excinfo.value)


def test_header_claiming_100000_squared_pixels_is_refused_quickly():
    data = png_with_header_size(100_000, 100_000)  # 10^10 pixels: 30 GB as RGB
    start = time.perf_counter()
    for limit in (1_000_000, None):  # our limit, and Pillow's decompression-bomb limit alone
        with pytest.raises(ResourceExhausted) as excinfo:
            decode_image(data, max_image_pixels=limit)
        assert "10000000000" in str(excinfo.value)
    assert time.perf_counter() - start < 5.0  # generous for a loaded CI machine; a decode would not end


@pytest.mark.parametrize(
    ("mode", "save_kwargs"),
    [("RGB", {"quality": 80}), ("RGB", {"lossless": True}), ("RGBA", {"lossless": True})],
    ids=["lossy-VP8", "lossless-VP8L", "alpha-VP8X"],
)
def test_webp_pixel_limit_is_exact_for_every_webp_header_kind(mode: str, save_kwargs: dict):
    # libwebp allocates its canvas inside Image.open, so WebP sizes are read from the RIFF header.
    data = encode(rgb_image(30, 50, seed=18).convert(mode), "WEBP", **save_kwargs)
    with pytest.raises(ResourceExhausted, match="50x30 = 1500 pixels"):
        decode_image(data, max_image_pixels=30 * 50 - 1)
    # Its decode memory too (17 bytes a pixel without alpha), against the budget of 12 bytes for each
    # pixel the limit allows: exact from the header as well.
    enough = -(-30 * 50 * 17 // DECODE_BYTES_PER_LIMIT_PIXEL)
    assert decode_image(data, max_image_pixels=enough).size == (50, 30)
    with pytest.raises(ResourceExhausted, match=r"WEBP image of 50x30 takes about .* memory"):
        decode_image(data, max_image_pixels=enough - 1)


def test_webp_with_huge_header_is_refused_before_libwebp_sees_it():
    data = bytearray(encode(rgb_image(4, 4), "WEBP", lossless=True))
    assert data[12:16] == b"VP8L"
    bits = (4000 - 1) | ((4000 - 1) << 14) | (int.from_bytes(data[21:25], "little") & ~((1 << 28) - 1))
    data[21:25] = bits.to_bytes(4, "little")
    with pytest.raises(ResourceExhausted, match="4000x4000 = 16000000 pixels"):
        decode_image(bytes(data), max_image_pixels=1_000_000)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_pillow_bomb_warning_threshold_is_a_typed_error_even_with_a_higher_limit(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)
    with pytest.raises(ResourceExhausted, match="10000 pixels"):
        decode_image(encode(rgb_image(120, 120), "PNG"), max_image_pixels=10**9)


def test_image_at_the_pixel_limit_is_accepted():
    assert decode_image(encode(rgb_image(100, 100), "PNG"), max_image_pixels=10_000).size == (100, 100)


def test_aspect_ratio_over_200_is_invalid():
    with pytest.raises(InvalidInput, match="aspect ratio"):
        decode_image(encode(rgb_image(2, 403), "PNG"), None)
    with pytest.raises(InvalidInput, match="aspect ratio"):
        preprocess_qwen2_vl(encode(rgb_image(403, 2), "PNG"), Qwen2VLPreprocessConfig())


def test_preprocess_passes_the_pixel_limit_to_decode():
    with pytest.raises(ResourceExhausted):
        preprocess_qwen2_vl(encode(rgb_image(100, 100), "PNG"), Qwen2VLPreprocessConfig(), 9_999)


def test_non_rgb_image_without_convert_rgb_is_invalid():
    cfg = Qwen2VLPreprocessConfig.from_dict({"do_convert_rgb": False})
    with pytest.raises(InvalidInput, match="not RGB"):
        preprocess_qwen2_vl(encode(rgb_image(56, 56).convert("L"), "PNG"), cfg)
    assert_matches_transformers(encode(rgb_image(56, 84), "PNG"), {"do_convert_rgb": False})


def test_unresized_image_must_be_a_multiple_of_the_merged_patch():
    cfg = Qwen2VLPreprocessConfig.from_dict({"do_resize": False})
    with pytest.raises(InvalidInput, match="multiple of 28"):
        preprocess_qwen2_vl(encode(rgb_image(56, 60), "PNG"), cfg)
    assert_matches_transformers(encode(rgb_image(56, 84), "PNG"), {"do_resize": False})


# ---------------------------------------------------------------------------------------------
# smart_resize


@settings(max_examples=400, deadline=None)
@given(
    height=st.integers(1, 20_000),
    width=st.integers(1, 20_000),
    factor=st.sampled_from([14, 28, 32]),
    min_pixels=st.integers(1, 4096 * 28),
    extra_pixels=st.integers(0, 16384 * 28 * 28),
)
def test_smart_resize_matches_transformers(height, width, factor, min_pixels, extra_pixels):
    max_pixels = min_pixels + extra_pixels
    if max(height, width) / min(height, width) > 200:
        with pytest.raises(InvalidInput):
            smart_resize(height, width, factor, min_pixels, max_pixels)
        return
    expected = qwen2_vl_pil.smart_resize(height, width, factor, min_pixels, max_pixels)
    assert smart_resize(height, width, factor, min_pixels, max_pixels) == expected


def test_smart_resize_aspect_ratio_error_is_invalid_input():
    with pytest.raises(InvalidInput, match="aspect ratio"):
        smart_resize(1, 201, 28, 3136, 1003520)
