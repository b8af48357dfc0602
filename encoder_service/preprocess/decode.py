"""Image bytes -> PIL image: bounded, strict decoding shared by every model's preprocessing.

Parity target: the model's transformers image processor fed ``PIL.Image.open(io.BytesIO(data))``.
Two deliberate additions over that target: EXIF orientation is applied (as transformers'
``load_image`` and vLLM do; the processor itself never looks at EXIF), and limits are enforced
from the header before any pixel is decoded.

Decode bombs (files whose decoding costs far more than their bytes or pixels suggest) are refused
before the cost is paid: the pixel limit (by default a multiple of the model's own ``max_pixels``,
``derived_pixel_limit``), a JPEG's scans counted from its bytes (``jpeg_scans``), each image's
decode memory estimated from its header (``_check_memory``), and a time budget checked at every read
of the file (``decode_budget``), which also lets the engine decode the images that are expensive by
their header apart from ordinary ones (``ExpensiveImage``).
"""

from __future__ import annotations

import contextlib
import io
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from encoder_service.errors import DecodeTimeout, InvalidInput, ResourceExhausted

from . import jpeg_direct
from .thread_hook import ThreadHook

# Only the formats the service promises. Pillow's full plugin list includes parsers few people
# audit (and EPS, which shells out to Ghostscript); a caller must not be able to reach them.
SUPPORTED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF")

# smart_resize's rule for every Qwen-style model; checked here from the header so that a 1x100000
# strip is refused before its pixels are decoded.
MAX_ASPECT_RATIO = 200

# Scans of a JPEG: a progressive file may hold any number, and libjpeg makes a pass over every
# block of the image for each, even an empty one of a dozen bytes (an 8192x8192 file of 1.1 MB with
# tens of thousands of them took 32 s of a core: the "EOB run" scan bomb, LJT-01-003 in
# libjpeg-turbo's report on the JPEG standard). Real encoders write few: libjpeg's (and Pillow's,
# libjpeg-turbo's, ImageMagick's, GIMP's) default progressive script has 10 scans for colour and 6
# for grayscale, mozjpeg's at most 11 (its scan search tries 64 candidates and writes some of them),
# Photoshop's 3 to 5; a sequential JPEG has one per component. Above MAX_JPEG_SCANS no real file has
# been seen; it keeps the worst case at 100 passes (about 1.5 s of a core at 16 Mpx) where DALI's
# generic limit of 500 would allow five times that. Above ORDINARY_JPEG_SCANS a file is allowed but
# expensive: the engine decodes it apart from ordinary images.
MAX_JPEG_SCANS = 100
ORDINARY_JPEG_SCANS = 16
# Bounds on the Python work of counting: segments read before the first scan (a real header has a
# dozen), and markers visited by the exact count (a progressive file has about 40). Past either,
# the cheap upper bound stands in for the exact count.
_MAX_HEADER_SEGMENTS = 256
_MAX_COUNTED_MARKERS = 4096
_PROGRESSIVE_SOF = (0xC2, 0xC6, 0xCA, 0xCE)
# Segments before the first scan that carry a length: APPn, COM, DQT, DHT, DRI, DAC.
_HEADER_SEGMENT_MARKERS = frozenset((*range(0xE0, 0xF0), 0xFE, 0xDB, 0xC4, 0xDD, 0xCC))

# The default pixel limit (--max-image-pixels -1): this many times the model's max_pixels, the size
# its preprocessing resizes every image down to. 16 lets a 12 Mpx phone photo (4000x3000) through for
# Qwen2.5-VL-7B (max_pixels 1003520: the limit is 16.1 Mpx), where the old fixed 64 Mi pixels was 67
# times what the model uses. At most the old default, for models whose max_pixels is large already
# (Qwen3-VL's 16.8 Mpx); 64 Mi when the model states none.
PIXEL_LIMIT_MAX_PIXELS_MULTIPLE = 16
PIXEL_LIMIT_CAP = 64 << 20

# Decode memory per image: the peak bytes per pixel measured (VmHWM, Pillow 13 with libwebp 1.6) for
# the whole CPU half (decode, to_rgb, the uint8 array handed over), by what the header says. WebP
# decodes through libwebp's animation decoder whatever the file: two RGBA canvases, the frame copied
# out as bytes, then into Pillow's image (a 38-byte lossless file of 8192x8192 peaks at 1.1 GB).
# Transparency is composited through RGBA copies (to_rgb). A JPEG may need its coefficients (a
# progressive one) or a CMYK image beside the RGB one. Everything else: Pillow's RGBX image, the
# array, and the bytes it is built from.
_BYTES_PER_PIXEL_WEBP, _BYTES_PER_PIXEL_WEBP_ALPHA = 17, 27
_BYTES_PER_PIXEL_ALPHA, _BYTES_PER_PIXEL_JPEG, _BYTES_PER_PIXEL_OTHER = 20, 12, 10
# The budget: this many bytes for each pixel the pixel limit allows, what the costliest ordinary
# image (a JPEG) needs at that limit. WebP and images with transparency are refused at a
# proportionally smaller size (WebP: 12/17 of the pixel limit).
DECODE_BYTES_PER_LIMIT_PIXEL = 12

_ORIENTATION_TAG = 0x0112  # EXIF Orientation
# What Pillow raises from a header or a pixel stream it cannot parse. zlib/struct errors escape
# some plugins unwrapped; EOFError comes from GIF/WebP frame readers.
_PIL_PARSE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)
# Pillow's EXIF reading and writing back (exif_transpose) raise TypeError too, for a tag of the wrong type (an
# ASCII resolution): the file's fault, not the server's.
_EXIF_ERRORS = (*_PIL_PARSE_ERRORS, TypeError)


def _pixel_limit(max_image_pixels: int | None) -> int | None:
    """The tighter of the caller's limit and Pillow's decompression-bomb limit.

    Pillow warns above ``Image.MAX_IMAGE_PIXELS`` and raises above twice that. We refuse at the
    warning threshold ourselves instead of escalating the warning with ``warnings.catch_warnings``:
    that context manager swaps the process-global filter list and is not thread-safe, and
    decoding runs on worker threads.
    """
    limits = [lim for lim in (max_image_pixels, Image.MAX_IMAGE_PIXELS) if lim is not None]
    return min(limits) if limits else None


def derived_pixel_limit(model_max_pixels: int | None) -> int:
    """The default pixel limit: ``PIXEL_LIMIT_MAX_PIXELS_MULTIPLE`` times the model's max_pixels, at
    most ``PIXEL_LIMIT_CAP`` (which is also the limit of a model that states no max_pixels)."""
    if not model_max_pixels:
        return PIXEL_LIMIT_CAP
    return min(PIXEL_LIMIT_MAX_PIXELS_MULTIPLE * model_max_pixels, PIXEL_LIMIT_CAP)


def model_max_pixels(preprocess_config: object) -> int | None:
    """The pixels a family's preprocessing resizes an image down to (``max_pixels`` of its config),
    None where the config states none (a stand-in model's)."""
    value = getattr(preprocess_config, "max_pixels", None)
    return int(value) if value else None


def _frame(data: bytes) -> tuple[int, int, int] | None:
    """A JPEG's header walked to its first scan: (its SOFn marker, the frame's components, the first
    scan's components); None where the walk finds no such header or cannot be done cheaply (two
    frames, a marker a header does not hold, more than ``_MAX_HEADER_SEGMENTS`` segments)."""
    walked = _walk_header(data, _MAX_HEADER_SEGMENTS, fill=True)
    return None if walked is None else walked[:3]


def _walk_header(data: bytes, max_segments: int, *, fill: bool) -> tuple[int, int, int, int] | None:
    """``_frame``'s walk, and where the first scan's SOS marker starts; ``fill``: fill bytes before a
    marker are allowed (each counts as a segment), else such a header is not walked."""
    pos, frame = 2, None
    for _ in range(max_segments):
        if pos + 10 > len(data) or data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            if not fill:
                return None
            pos += 1
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # SOFn
            if frame is not None:
                return None
            frame = (marker, data[pos + 9])
        elif marker == 0xDA:
            return None if frame is None else (*frame, data[pos + 4], pos)
        elif marker not in _HEADER_SEGMENT_MARKERS:
            # A marker without a length (RSTn, TEM, a stuffed 0x00) or one a header does not hold:
            # reading a length after it would land this walk where libjpeg never looks (a fake
            # one-scan header hidden in a COM segment hid 20,000 scans that way). Count instead.
            return None
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if length < 2:
            return None
        pos += 2 + length
    return None


def plain_jpeg_header(data: bytes, max_bytes: int, max_segments: int) -> bool:
    """Whether a JPEG is cheap to read up to its pixels, whatever its size: its header (Pillow parses it
    in Python, a call per segment and a read per fill byte) walks to the first scan within ``max_bytes``
    in at most ``max_segments`` segments, without fill bytes; and counting its scans needs no walk of
    its markers (one scan by its header, or at most ``ORDINARY_JPEG_SCANS`` FF DA byte pairs in it)."""
    walked = _walk_header(data, max_segments, fill=False) if is_jpeg(data) else None
    if walked is None or walked[3] > max_bytes:
        return False
    return _single_scan(data) or _sos_bytes(np.frombuffer(data, dtype=np.uint8)) <= ORDINARY_JPEG_SCANS


def _single_scan(data: bytes) -> bool:
    """Whether a JPEG's header makes libjpeg refuse any scan after the first: a sequential frame
    whose first scan holds all its components (libjpeg then expects EOI: "broken data stream").
    False where the header says otherwise or cannot be walked cheaply."""
    frame = _frame(data)
    return frame is not None and frame[0] not in _PROGRESSIVE_SOF and frame[1] == frame[2]


_WINDOW = 1 << 20  # bytes searched at a time: the counting's memory stays a few MB whatever the file


def _sos_bytes(raw: np.ndarray) -> int:
    """How many times the bytes FF DA occur in ``raw``."""
    total = 0
    for start in range(0, len(raw) - 1, _WINDOW):
        window = raw[start:start + _WINDOW + 1]
        total += int(np.count_nonzero((window[:-1] == 0xFF) & (window[1:] == 0xDA)))
    return total


def _next_marker(raw: np.ndarray, pos: int) -> int:
    """Where the next marker (0xFF followed by neither 0x00, a stuffed 0xFF; 0xFF, fill; TEM nor
    RSTn, which have no length) starts at or after ``pos``; -1 if none. Searches a window that
    doubles from 4 KB, so a near marker costs little and a far one one pass."""
    width = 4096
    while pos < len(raw) - 1:
        window = raw[pos:pos + width + 1]
        ff = np.flatnonzero(window[:-1] == 0xFF)
        code = window[ff + 1]
        hits = np.flatnonzero((code != 0x00) & (code != 0xFF) & (code != 0x01) & ((code < 0xD0) | (code > 0xD7)))
        if len(hits):
            return pos + int(ff[hits[0]])
        pos += width
        width = min(2 * width, _WINDOW)
    return -1


def is_jpeg(data: bytes) -> bool:
    """Whether ``data`` starts as a JPEG does (SOI): what libjpeg and Pillow take for one."""
    return data[:2] == b"\xff\xd8"


def jpeg_scans(data: bytes) -> int:
    """How many scans (SOS markers) libjpeg would read in ``data``, counted up to
    ``MAX_JPEG_SCANS + 1``; 0 for bytes that are not a JPEG.

    A sequential JPEG whose first scan holds every component can have no other (``_single_scan``):
    1, from its header alone, the usual photo. Otherwise every SOS marker is the bytes FF DA, so
    counting those (numpy, at memory speed) bounds the scans from above; scan data cannot hold them
    (a 0xFF there is followed by 0x00 or a restart marker), but metadata can (an ICC profile, an
    EXIF thumbnail). Only when that bound is over ``ORDINARY_JPEG_SCANS`` are the markers walked as
    libjpeg reads them: a segment's parameters skipped by their length, scan data and stray bytes
    searched for the next marker, up to EOI."""
    if not is_jpeg(data):
        return 0
    if _single_scan(data):
        return 1
    raw = np.frombuffer(data, dtype=np.uint8)
    upper = _sos_bytes(raw)
    if upper <= ORDINARY_JPEG_SCANS:
        return upper
    scans, pos = 0, 2
    for _ in range(_MAX_COUNTED_MARKERS):
        at = _next_marker(raw, pos)
        if at < 0 or data[at + 1] in (0xD8, 0xD9):  # EOI ends the image; a second SOI is an error to libjpeg
            return scans
        if data[at + 1] == 0xDA:
            scans += 1
            if scans > MAX_JPEG_SCANS:
                return scans
        # The segment's parameters (for SOS, its header: the scan data follows and is searched).
        pos = at + 2 + max(2, int.from_bytes(data[at + 2:at + 4], "big"))
    return min(upper, MAX_JPEG_SCANS + 1)


def check_jpeg_scans(data: bytes) -> int:
    """The scans of a JPEG (0 for other bytes); ResourceExhausted over ``MAX_JPEG_SCANS``."""
    scans = jpeg_scans(data)
    if scans > MAX_JPEG_SCANS:
        raise ResourceExhausted(
            f"JPEG has more than {MAX_JPEG_SCANS} scans, over the limit of {MAX_JPEG_SCANS} scans per image "
            f"(each scan is a pass over the whole image; encoders write at most about 11)")
    return scans


class ExpensiveImage(Exception):
    """Raised instead of decoding an image that is expensive by its header, inside a
    ``decode_budget(..., expensive_pixels=N)``: the caller decodes it elsewhere. Not an error."""


def _webp_header(data: bytes) -> tuple[int, int, bool] | None:
    """(width, height, has alpha) from a WebP file's first chunk header, or None if not WebP / not known."""
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    chunk = data[12:16]
    if chunk == b"VP8X":  # extended: flags (alpha: 0x10), 24-bit canvas width-1, height-1
        return (int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1,
                bool(data[20] & 0x10))
    if chunk == b"VP8L" and data[20] == 0x2F:  # lossless: 14-bit width-1, height-1, alpha_is_used
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, bool(bits >> 28 & 1)
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":  # lossy key frame: 14-bit sides, no alpha
        return (
            int.from_bytes(data[26:28], "little") & 0x3FFF,
            int.from_bytes(data[28:30], "little") & 0x3FFF,
            False,
        )
    return None


def _check_memory(fmt: str, width: int, height: int, bytes_per_pixel: int, limit: int | None) -> None:
    """Refuses an image whose decode would need more than the budget (``DECODE_BYTES_PER_LIMIT_PIXEL``
    bytes for each pixel the limit allows), from its header, before anything is allocated."""
    if limit is None:
        return
    need, budget = width * height * bytes_per_pixel, limit * DECODE_BYTES_PER_LIMIT_PIXEL
    if need > budget:
        raise ResourceExhausted(
            f"decoding this {fmt} image of {width}x{height} takes about {need >> 20} MiB of memory "
            f"({bytes_per_pixel} bytes a pixel), over the limit of {budget >> 20} MiB per image "
            f"({DECODE_BYTES_PER_LIMIT_PIXEL} bytes for each of the {limit} pixels the pixel limit allows)")


def _bytes_per_pixel(image: Image.Image) -> int:
    """Peak decode bytes per pixel of an image Pillow has opened (its header parsed; not WebP)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        return _BYTES_PER_PIXEL_ALPHA
    return _BYTES_PER_PIXEL_JPEG if image.format == "JPEG" else _BYTES_PER_PIXEL_OTHER


# --- the time budget, and where expensive images go --------------------------------------------------

_budget = threading.local()  # .seconds, .expensive_pixels: for the decodes running on this thread


@contextlib.contextmanager
def decode_budget(seconds: float | None, expensive_pixels: int | None = None) -> Iterator[None]:
    """Limits on every ``open_image`` on this thread inside the block.

    ``seconds`` (None: none): the decode stops with DecodeTimeout (a ResourceExhausted) once it has
    run this long.
    Checked at each read of the file: Pillow feeds its decoders 64 KB at a time and parses PNG
    chunks one read at a time, so a decode overruns by at most what one read's bytes cost (bounded
    by the scan and pixel limits); WebP decodes in one call (bounded by its memory limit).

    ``expensive_pixels`` (None: decode everything): an image that passes every limit but is
    expensive by its header (a JPEG of more than ``ORDINARY_JPEG_SCANS`` scans, or of more pixels
    than this) raises ``ExpensiveImage`` before any of its pixels is decoded."""
    previous = getattr(_budget, "seconds", None), getattr(_budget, "expensive_pixels", None)
    _budget.seconds, _budget.expensive_pixels = seconds, expensive_pixels
    try:
        yield
    finally:
        _budget.seconds, _budget.expensive_pixels = previous


def routing_expensive() -> bool:
    """Whether this thread's ``decode_budget`` sends expensive images elsewhere: the ordinary decode
    threads' budget (the expensive pool's decodes everything it is given)."""
    return getattr(_budget, "expensive_pixels", None) is not None


def _route(pixels: int, scans: int) -> None:
    """Raises ExpensiveImage where the thread's ``decode_budget`` sends expensive images elsewhere."""
    expensive_pixels = getattr(_budget, "expensive_pixels", None)
    if expensive_pixels is not None and (scans > ORDINARY_JPEG_SCANS or pixels > expensive_pixels):
        raise ExpensiveImage(f"{pixels} pixels, {scans} scans")


class _BudgetedBytes(io.BytesIO):
    """The file's bytes for Pillow, each read refused once the decode is past its deadline."""

    def __init__(self, data: bytes, seconds: float) -> None:
        super().__init__(data)
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def read(self, size: int | None = -1) -> bytes:
        if time.monotonic() > self.deadline:
            raise DecodeTimeout(f"decoding the image took more than {self.seconds:g} s, over the limit of "
                                f"--max-decode-seconds {self.seconds:g}")
        return super().read(size)


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
    ratio over 200, ResourceExhausted when the header claims more pixels than allowed, when the
    decode would need more memory than the limit allows for them, for a JPEG of more than
    ``MAX_JPEG_SCANS`` scans, and when the decode outlasts its ``decode_budget``; ExpensiveImage
    where the ``decode_budget`` sends expensive images elsewhere.
    """
    return _loaded(_opened(data, max_image_pixels)[0])


def _loaded(image: Image.Image) -> Image.Image:
    """``_opened``'s image decoded and EXIF-oriented (``open_image``)."""
    try:
        image.load()
    except Image.DecompressionBombError as e:
        raise ResourceExhausted(f"image is over the pixel limit: {e}") from None
    except _PIL_PARSE_ERRORS as e:
        raise InvalidInput(f"image data is truncated or corrupt: {type(e).__name__}: {e}") from None

    try:
        # in_place: no orientation tag (the usual case) must not cost a copy of the pixels.
        ImageOps.exif_transpose(image, in_place=True)
    except _EXIF_ERRORS as e:
        raise InvalidInput(f"image has malformed EXIF metadata: {type(e).__name__}: {e}") from None
    return image


@dataclass(frozen=True)
class Header:
    """What an image's header says, every limit of ``open_image`` checked: its format and its size as
    displayed (after the EXIF orientation)."""

    format: str
    height: int
    width: int


def read_header(data: bytes, max_image_pixels: int | None) -> Header | None:
    """The header of a JPEG or PNG, with every check ``open_image`` makes before it decodes a pixel
    (same errors, ``ExpensiveImage`` included), and no pixel decoded; None for other formats, and for
    a PNG that may carry its orientation after its pixels (an eXIf or text chunk after IDAT: Pillow reads
    those only while decoding), whose displayed size only the decode can tell."""
    if data[:2] != b"\xff\xd8" and data[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    if data[:1] == b"\x89" and _png_metadata_after_pixels(data):
        return None
    image, _ = _opened(data, max_image_pixels)
    if image.format not in ("JPEG", "PNG", "MPO"):
        return None
    orientation = 1
    # A JPEG's EXIF is in its header (APP1). A PNG's orientation may be in an eXIf chunk, a "Raw profile type
    # exif" text chunk or XMP (tiff:Orientation), all of which exif_transpose reads; those after the pixels
    # were ruled out above, those before are in ``info`` now. PngImageFile.getexif decodes the image when
    # ``info`` has no "exif": the base class's reads ``info`` only.
    if image.format != "PNG" or any(key in image.info for key in _PNG_ORIENTATION_KEYS):
        orientation = _orientation(image)
    width, height = image.size
    if orientation in (5, 6, 7, 8):  # a quarter turn (exif_transpose): the sides swap
        width, height = height, width
    return Header(image.format, height, width)


_MAX_PNG_CHUNKS_WALKED = 4096  # a real PNG has a few dozen to a few hundred (IDAT in 8-64 KB chunks)
# Where Pillow finds a PNG's orientation (Image.getexif): an eXIf chunk, ImageMagick's text chunk, XMP.
_PNG_ORIENTATION_KEYS = ("exif", "Raw profile type exif", "XML:com.adobe.xmp", "xmp")
_PNG_METADATA_CHUNKS = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")


def _png_metadata_after_pixels(data: bytes) -> bool:
    """Whether a PNG may hold metadata that sets its orientation after its first IDAT (an eXIf chunk, or a
    text chunk: Pillow reads those only while decoding): its chunk headers walked by their lengths
    (searching the whole file for the letters cost 7 ms for 9 MB). True too where the walk cannot tell
    (more chunks than ``_MAX_PNG_CHUNKS_WALKED``, or a length past the end)."""
    offset, seen_pixels = 8, False
    for _ in range(_MAX_PNG_CHUNKS_WALKED):
        if offset + 8 > len(data):
            return True
        length, kind = int.from_bytes(data[offset:offset + 4], "big"), data[offset + 4:offset + 8]
        if kind == b"IEND":
            return False
        if kind == b"IDAT":
            seen_pixels = True
        elif kind in _PNG_METADATA_CHUNKS and seen_pixels:
            return True
        offset += 12 + length  # length, type, data, CRC
    return True


def _opened(data: bytes, max_image_pixels: int | None) -> tuple[Image.Image, int]:
    """Pillow's image of ``data`` with its header parsed and every limit checked, no pixel decoded; and
    its JPEG scans (0 for other formats), counted for those limits."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        # With this flag Pillow silently pads a truncated image with black and we would encode
        # (and cache) garbage. Someone in the process turned it on; fail loudly, not wrongly.
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is on; refusing to decode images")
    if not data:
        raise InvalidInput("not a decodable image: empty bytes")

    limit = _pixel_limit(max_image_pixels)
    scans = check_jpeg_scans(data)
    webp = _webp_header(data)
    if webp is not None:
        # libwebp allocates the whole canvas inside Image.open, before we could look at .size.
        width, height, alpha = webp
        _check_header_size(width, height, limit)
        _check_memory("WEBP", width, height, _BYTES_PER_PIXEL_WEBP_ALPHA if alpha else _BYTES_PER_PIXEL_WEBP, limit)
        _route(width * height, scans)
    seconds = getattr(_budget, "seconds", None)
    source = io.BytesIO(data) if seconds is None else _BudgetedBytes(data, seconds)
    try:
        image = Image.open(source, formats=SUPPORTED_FORMATS)
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
    if webp is None:
        _check_memory(image.format, *image.size, _bytes_per_pixel(image), limit)
        _route(image.width * image.height, scans)
    return image, scans


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


# The frames jpeg_direct takes: baseline, extended sequential and progressive Huffman coding.
_DIRECT_SOF = (0xC0, 0xC1, 0xC2)


def decode_rgb(data: bytes, max_image_pixels: int | None) -> np.ndarray:
    """``decode_image``'s pixels as a uint8 [H, W, 3] array, its limits and errors the same: a plain JPEG
    decoded by libjpeg-turbo straight into the array (``jpeg_direct``: the same pixels, sooner),
    everything else, and any JPEG that path does not take, by Pillow."""
    image, scans = _opened(data, max_image_pixels)
    if image.format == "JPEG" and image.mode in ("RGB", "L"):
        frame = _frame(data)
        if (frame is not None and frame[0] in _DIRECT_SOF and frame[1] in (1, 3)
                and scans <= ORDINARY_JPEG_SCANS and jpeg_direct.agrees_with_pillow()):
            orientation = _orientation(image)
            _exif_written_back(image, orientation)
            pixels = jpeg_direct.decode(data, (image.height, image.width), orientation, _into)
            if pixels is not None:
                return pixels
    return np.asarray(to_rgb(_loaded(image)))


def _exif_written_back(image: Image.Image, orientation: int) -> None:
    """Fails as ``exif_transpose`` fails on ``image``'s metadata, without its pixels: where it turns an image
    (orientations 2 to 8) it writes the EXIF back without the tag, and a file whose EXIF cannot be written
    back is refused there (InvalidInput). Run on a 1x1 stand-in carrying the file's metadata, so that the
    image itself keeps its orientation for Pillow should the direct path hand the file over."""
    if orientation not in (2, 3, 4, 5, 6, 7, 8):
        return
    stand_in = Image.new("L", (1, 1))
    stand_in.info = dict(image.info)
    try:
        ImageOps.exif_transpose(stand_in, in_place=True)
    except _EXIF_ERRORS as e:
        raise InvalidInput(f"image has malformed EXIF metadata: {type(e).__name__}: {e}") from None


_into = ThreadHook()


def decode_into(take: Callable[[int], np.ndarray | None]) -> contextlib.AbstractContextManager[None]:
    """Within the block, a plain JPEG decoded on this thread (``decode_rgb``) lands in ``take(nbytes)``
    where that gives a writable uint8 array of ``nbytes`` (None: new memory, as everywhere else). The
    engine's decode threads hand out memory already mapped (engine/warm_memory.py): the first image
    after an idle spell then decodes without a page fault."""
    return _into.set(take)


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation of an opened image (1 where it has none), as ``exif_transpose`` reads it
    (the base class's ``getexif``: PngImageFile's would decode the pixels to find it)."""
    try:
        return Image.Image.getexif(image).get(_ORIENTATION_TAG, 1)
    except _EXIF_ERRORS as e:
        raise InvalidInput(f"image has malformed EXIF metadata: {type(e).__name__}: {e}") from None
