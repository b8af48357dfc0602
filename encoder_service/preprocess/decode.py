"""Image bytes -> PIL image: bounded, strict decoding shared by every model's preprocessing.

Parity target: the model's transformers image processor fed ``PIL.Image.open(io.BytesIO(data))``.
Two deliberate additions over that target: EXIF orientation is applied (as transformers'
``load_image`` and vLLM do; the processor itself never looks at EXIF), and limits are enforced
from the header before any pixel is decoded.
"""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from encoder_service.errors import InvalidInput, ResourceExhausted

# Only the formats the service promises. Pillow's full plugin list includes parsers few people
# audit (and EPS, which shells out to Ghostscript); a caller must not be able to reach them.
SUPPORTED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF")

# smart_resize's rule for every Qwen-style model; checked here from the header so that a 1x100000
# strip is refused before its pixels are decoded.
MAX_ASPECT_RATIO = 200

# What Pillow raises from a header or a pixel stream it cannot parse. zlib/struct errors escape
# some plugins unwrapped; EOFError comes from GIF/WebP frame readers.
_PIL_PARSE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)


def _pixel_limit(max_image_pixels: int | None) -> int | None:
    """The tighter of the caller's limit and Pillow's decompression-bomb limit.

    Pillow warns above ``Image.MAX_IMAGE_PIXELS`` and raises above twice that. We refuse at the
    warning threshold ourselves instead of escalating the warning with ``warnings.catch_warnings``:
    that context manager swaps the process-global filter list and is not thread-safe, and
    decoding runs on worker threads.
    """
    limits = [lim for lim in (max_image_pixels, Image.MAX_IMAGE_PIXELS) if lim is not None]
    return min(limits) if limits else None


def _webp_canvas_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a WebP file's first chunk header, or None if not WebP / not known."""
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    chunk = data[12:16]
    if chunk == b"VP8X":  # extended: 24-bit canvas width-1, height-1
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    if chunk == b"VP8L" and data[20] == 0x2F:  # lossless: 14-bit width-1, height-1 after signature
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":  # lossy key frame: 14-bit sides
        return (
            int.from_bytes(data[26:28], "little") & 0x3FFF,
            int.from_bytes(data[28:30], "little") & 0x3FFF,
        )
    return None


def _check_header_size(width: int, height: int, limit: int | None) -> None:
    if width <= 0 or height <= 0:
        raise InvalidInput(f"not a decodable image: header says {width}x{height}")
    pixels = width * height
    if limit is not None and pixels > limit:
        raise ResourceExhausted(
            f"image header claims {width}x{height} = {pixels} pixels, over the limit of {limit} pixels"
        )
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise InvalidInput(
            f"image aspect ratio {max(width, height) / min(width, height):.1f} ({width}x{height}) "
            f"is over the limit of {MAX_ASPECT_RATIO}"
        )


def open_image(data: bytes, max_image_pixels: int | None) -> Image.Image:
    """Decode ``data`` fully, in the file's own mode (P, L, RGBA, CMYK, ...), EXIF-oriented.

    Raises InvalidInput for empty / unrecognised / truncated / corrupt data and for an aspect
    ratio over 200, ResourceExhausted when the header claims more pixels than allowed.
    """
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        # With this flag Pillow silently pads a truncated image with black and we would encode
        # (and cache) garbage. Someone in the process turned it on; fail loudly, not wrongly.
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is on; refusing to decode images")
    if not data:
        raise InvalidInput("not a decodable image: empty bytes")

    limit = _pixel_limit(max_image_pixels)
    webp_size = _webp_canvas_size(data)
    if webp_size is not None:
        # libwebp allocates the whole canvas inside Image.open, before we could look at .size.
        _check_header_size(*webp_size, limit)
    try:
        image = Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
    except Image.DecompressionBombError as e:
        # Pillow refuses inside Image.open past twice its own limit, before we see .size; its
        # message names the claimed pixel count and the limit it applied.
        raise ResourceExhausted(f"image header is over the pixel limit: {e}") from None
    except UnidentifiedImageError:
        raise InvalidInput(
            f"not a decodable image: format not recognised (supported: {', '.join(SUPPORTED_FORMATS)})"
        ) from None
    except _PIL_PARSE_ERRORS as e:
        # A recognised format whose header (or, for WebP, whole stream) does not parse.
        raise InvalidInput(f"not a decodable image (truncated or corrupt): {type(e).__name__}: {e}") from None

    # Image.open has parsed the header only; nothing below allocates pixels until load().
    _check_header_size(*image.size, limit)

    try:
        image.load()
    except Image.DecompressionBombError as e:
        raise ResourceExhausted(f"image is over the pixel limit: {e}") from None
    except _PIL_PARSE_ERRORS as e:
        raise InvalidInput(f"image data is truncated or corrupt: {type(e).__name__}: {e}") from None

    try:
        # in_place: no orientation tag (the usual case) must not cost a copy of the pixels.
        ImageOps.exif_transpose(image, in_place=True)
    except _PIL_PARSE_ERRORS as e:
        raise InvalidInput(f"image has malformed EXIF metadata: {type(e).__name__}: {e}") from None
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert to RGB exactly as transformers' ``convert_to_rgb`` does for a PIL image.

    Anything with transparency (an alpha band, or a ``transparency`` entry: palette tRNS, an RGB or L
    colour key, GIF transparent index) is composited onto opaque white. Pillow's own
    ``convert("RGB")`` would instead drop alpha and keep whatever colour hides under transparent
    pixels, so the two differ; we follow transformers. Modes with premultiplied alpha ("RGBa",
    "La") have a lowercase band name, so transformers (and we) take the plain ``convert`` path.
    """
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if image.mode == "RGB":
        return image
    return image.convert("RGB")


def decode_image(data: bytes, max_image_pixels: int | None) -> Image.Image:
    """Decode JPEG / PNG / WebP / GIF (first frame) bytes into an EXIF-oriented RGB image.

    ``max_image_pixels`` bounds width*height as claimed by the header, checked before decoding;
    Pillow's own ``Image.MAX_IMAGE_PIXELS`` applies on top (the tighter wins).
    """
    return to_rgb(open_image(data, max_image_pixels))
