"""A plain JPEG decoded by libjpeg-turbo straight into an RGB array: Pillow's pixels, a third sooner.

Why: Pillow decodes into its own image (four bytes a pixel), and the uint8 array the device half
takes is a second pass over it, a copy. simplejpeg drives the same library (libjpeg-turbo, through its
TurboJPEG API) with the same settings Pillow leaves at libjpeg's defaults (the accurate integer IDCT,
fancy chroma upsampling) and writes RGB rows into the array itself: a 1008x1008 photo decoded in
3.9 ms against 4.9 ms on the 2-core CPU host, 6.2 against 7.3 ms on an H200 host's core
(bench/RESULTS.md). The pixels are the ones Pillow gives, byte for byte: tests/preprocess/test_jpeg_direct.py
holds that over every chroma subsampling Pillow, libjpeg-turbo and FFmpeg write, progressive files, restart
markers, grayscale, odd sizes, qualities and every EXIF orientation.
It is what keeps the service equal to transformers, which decodes with Pillow.

Which files (``decode.decode_rgb`` asks): a sequential or progressive Huffman-coded JPEG (SOF0, SOF1,
SOF2) of one or three components that libjpeg reads as grayscale or YCbCr, of at most
``ORDINARY_JPEG_SCANS`` scans, every limit of ``decode.open_image`` checked from its header before.
Everything else goes to Pillow: CMYK and YCCK, RGB-coded and arithmetic-coded files, files of more
scans (Pillow's decode reads them in pieces, each piece checked against the decode's time budget; this
one is a single call, bounded by the pixel limit and the scans), and any file libjpeg-turbo warns
about (``strict``: corrupt data, a premature end), for which Pillow's decode gives the answer it
always gave: the pixels or the error.
"""

from __future__ import annotations

import functools
import io
import logging
from collections.abc import Callable

import numpy as np
import simplejpeg
from PIL import Image

log = logging.getLogger(__name__)

# What libjpeg-turbo's header reading calls the colour spaces this path takes (TurboJPEG's TJCS_YCbCr and
# TJCS_GRAY, as simplejpeg names them): libjpeg converts both to RGB as Pillow's decode and its L -> RGB
# conversion do (a grey byte copied to the three channels).
_COLOURSPACES = ("YCbCr", "Gray")


def decode(data: bytes, size: tuple[int, int], orientation: int,
           into: Callable[[int], np.ndarray | None] | None = None) -> np.ndarray | None:
    """uint8 [H, W, 3] RGB pixels of a JPEG, turned as its EXIF ``orientation`` says (as Pillow's
    ``exif_transpose`` turns them); None where this path does not take the file (see the module
    docstring), which Pillow then decodes. ``size`` is (height, width) as the header Pillow read says,
    against which every limit was checked: a file whose header libjpeg-turbo reads otherwise goes to
    Pillow too. ``into(nbytes)`` may give a writable uint8 array of that many bytes for the pixels to land
    in (memory whose pages are already mapped: ``decode.decode_into``)."""
    try:
        height, width, colourspace, _ = simplejpeg.decode_jpeg_header(data)
        if colourspace not in _COLOURSPACES or (height, width) != tuple(size):
            return None
        buffer = into(height * width * 3) if into is not None else None
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False, strict=True,
                                        buffer=buffer)
    except ValueError:  # libjpeg-turbo's error or warning: Pillow decides
        return None
    return oriented(pixels, orientation)


@functools.cache
def agrees_with_pillow() -> bool:
    """Whether simplejpeg's libjpeg-turbo decodes as Pillow's does in this process, checked once on small
    files made here: each chroma subsampling (Pillow's three, libjpeg-turbo's 4:4:0 and 4:1:1), progressive,
    a progressive file cut after its first scan (libjpeg smooths such blocks, and changed how in 3.0.1),
    grey. The two are separate builds of the library, each pinned by its package: where they differ (an
    upgrade of one), this path is off and Pillow decodes every file, with a warning saying so."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:29, 0:37]
    base = np.stack([xx * 7, yy * 9, (xx + yy) * 4], -1) + rng.integers(0, 40, (29, 37, 3))
    pixels = np.clip(base, 0, 255).astype(np.uint8)
    files = []
    for subsampling in (0, 1, 2):
        for progressive in (False, True):
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, "JPEG", quality=85, subsampling=subsampling, progressive=progressive)
            files.append(out.getvalue())
    second_scan = files[-1].find(b"\xff\xda", files[-1].find(b"\xff\xda") + 2)
    files.append(files[-1][:second_scan] + b"\xff\xd9")
    files += [simplejpeg.encode_jpeg(pixels, quality=85, colorsubsampling=sampling) for sampling in ("440", "411")]
    out = io.BytesIO()
    Image.fromarray(pixels[..., 0]).save(out, "JPEG", quality=85)
    files.append(out.getvalue())
    for data in files:
        want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        got = decode(data, want.shape[:2], 1)
        if got is None or not np.array_equal(got, want):
            log.warning("simplejpeg %s decodes JPEGs otherwise than Pillow %s here: every image decodes through "
                        "Pillow (a third slower for a plain JPEG)", simplejpeg.__version__, Image.__version__)
            return False
    return True


def oriented(pixels: np.ndarray, orientation: int) -> np.ndarray:
    """``pixels`` (H, W, C) turned as Pillow's ``ImageOps.exif_transpose`` turns an image of that EXIF
    orientation (1 and unknown values: unchanged), as a C-contiguous array."""
    turned = _TURNS.get(orientation)
    return pixels if turned is None else np.ascontiguousarray(turned(pixels))


# exif_transpose's transposes: 2 FLIP_LEFT_RIGHT, 3 ROTATE_180, 4 FLIP_TOP_BOTTOM, 5 TRANSPOSE, 6 ROTATE_270,
# 7 TRANSVERSE, 8 ROTATE_90 (Pillow's rotations turn counter-clockwise, as np.rot90's positive k does).
_TURNS = {
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, -1),
    7: lambda a: a.transpose(1, 0, 2)[::-1, ::-1],
    8: lambda a: np.rot90(a, 1),
}
