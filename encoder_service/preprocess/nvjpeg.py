"""Opt-in JPEG decoding on the GPU (``--decode nvjpeg``): the CPU reads only the header.

Decoding a 1008x1008 JPEG with Pillow (libjpeg-turbo) takes ~9-14 ms of a CPU core, most of what a
lone image waits for besides its forward; nvJPEG (``torchvision.io.decode_jpeg`` on CUDA) takes
~0.8 ms for one image and ~0.15 ms an image batched (bench/RESULTS.md). It is opt-in, never the
default: nvJPEG upsamples 4:2:0 chroma by nearest neighbour where libjpeg interpolates, so pixels
differ from Pillow's by a few levels on photos (more at sharp edges) and the embedding changes about
as much as running the tower in bf16 instead of float32 does. It is therefore part of
``cache_namespace``, and it needs torchvision at run time (never at import time: no torchvision build
imports next to the CPU torch our CI pins).

The CPU half (``NvjpegDecoder``) parses the header: format, size and the pixel limits (the same
checks and errors as Pillow's path), EXIF orientation. It hands the device half the file's bytes
(``JpegImage``); the device decodes a batch's JPEGs in one call, applies the orientation, and the
image continues as a decoded one in ``torch`` mode (resize, pad, normalize, patchify on the device).
With ``--devices`` the front end runs the CPU half and the file's bytes cross to the worker process
in the shared input buffer (engine/handoff.py), where the device half reads them in place.

Files nvJPEG is not given, decoded by Pillow as usual so that every image still decodes or is refused
in Pillow's words: anything but a baseline 3-component JPEG (progressive, grayscale, CMYK), a file
that does not end with its end-of-image marker (truncated: a GPU decoder might fill the rest), and
one whose scan data breaks JPEG's marker rules (damaged: nvJPEG decodes garbage without an error,
``scan_is_clean``). A JPEG whose data nvJPEG still rejects fails alone (``UndecodableInputs``): the
rest of its batch is encoded.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from ..errors import BackendUnavailable, InvalidInput
from .decode import _ORIENTATION_TAG, _PIL_PARSE_ERRORS, _check_header_size, _pixel_limit
from .staged import BytesPayload, DecodedImage, Grid

_SOI, _EOI = b"\xff\xd8", b"\xff\xd9"

# (resize_to, pad_to, grid) of an image of (height, width) pixels, after orientation: the family's
# geometry for its preprocessing settings.
Geometry = Callable[[int, int, object], tuple[tuple[int, int], tuple[int, int], Grid]]


@dataclass(frozen=True, eq=False)
class JpegImage(BytesPayload):
    """A JPEG's bytes, for the device to decode; the sizes are those after EXIF orientation."""

    data: bytes | memoryview  # a view of the shared input buffer in a worker process (--devices)
    orientation: int  # EXIF 1..8 (1: as stored)
    size: tuple[int, int]  # (height, width) as displayed, after the orientation
    resize_to: tuple[int, int]
    pad_to: tuple[int, int]
    grid: Grid


class UndecodableInputs(Exception):
    """Some inputs of a batch could not be decoded on the device: ``errors`` maps each one's index
    in the batch to its error. The others are fine and can be run without them."""

    def __init__(self, errors: dict[int, Exception]) -> None:
        super().__init__(f"{len(errors)} input(s) could not be decoded")
        self.errors = errors


def jpeg_header(data: bytes, max_image_pixels: int | None) -> tuple[int, int, int] | None:
    """(height, width, orientation) of a JPEG that nvJPEG should decode, sizes as stored; None for
    bytes Pillow should decode instead (see the module docstring). Raises InvalidInput /
    ResourceExhausted for a header over the limits, as Pillow's path does."""
    if data[:2] != _SOI or data[-2:] != _EOI:
        return None
    try:
        image = Image.open(io.BytesIO(data), formats=("JPEG",))  # the header only: no pixels decoded
        if image.mode != "RGB" or image.info.get("progressive") or image.info.get("progression"):
            return None
        orientation = image.getexif().get(_ORIENTATION_TAG, 1)
    except (Image.DecompressionBombError, *_PIL_PARSE_ERRORS):
        return None  # Pillow's path gives the error, in its words
    width, height = image.size
    _check_header_size(width, height, _pixel_limit(max_image_pixels))
    if not scan_is_clean(data):
        return None
    return height, width, orientation if orientation in range(1, 9) else 1


def scan_is_clean(data: bytes) -> bool:
    """Whether the entropy-coded data of a one-scan JPEG holds only the markers it may hold.

    nvJPEG decodes a stream of garbage without an error where libjpeg (Pillow) refuses it ("broken
    data stream"), and a server must not encode and cache garbage. Inside a scan, a 0xFF byte may
    only be followed by 0x00 (a stuffed 0xFF), a restart marker RST0-7, or more 0xFF fill; damaged
    or random data breaks that rule within a few hundred bytes. Files that break it, or that hold
    more than one scan, go to Pillow, which decodes them or says what is wrong. Subtler damage
    (flipped bits that keep the marker rule) is not caught, by Pillow either. ~0.1 ms a photo."""
    offset = 2
    while offset + 4 <= len(data):  # walk the header segments to the (first) start of scan
        if data[offset] != 0xFF:
            return False
        marker = data[offset + 1]
        if marker == 0xFF:  # fill byte before a marker
            offset += 1
            continue
        length = int.from_bytes(data[offset + 2:offset + 4], "big")
        if marker == 0xDA:
            scan = np.frombuffer(data, dtype=np.uint8, offset=offset + 2 + length)[:-2]  # up to the EOI
            follows = scan[np.flatnonzero(scan[:-1] == 0xFF) + 1]
            return bool(np.all((follows == 0x00) | (follows == 0xFF) | ((follows >= 0xD0) & (follows <= 0xD7))))
        offset += 2 + length
    return False


@dataclass(frozen=True)
class NvjpegDecoder:
    """The CPU half with ``--decode nvjpeg``: JPEGs to the device, anything else through ``fallback``
    (the family's Pillow decoder). Picklable, like the decoder it wraps."""

    fallback: Callable[[bytes, int | None], DecodedImage]
    geometry: Geometry
    config: object

    def __call__(self, image_bytes: bytes, max_image_pixels: int | None = None) -> DecodedImage | JpegImage:
        header = jpeg_header(image_bytes, max_image_pixels)
        if header is None:
            return self.fallback(image_bytes, max_image_pixels)
        height, width, orientation = header
        if orientation >= 5:  # a quarter turn: the image's sides swap
            height, width = width, height
        resize_to, pad_to, grid = self.geometry(height, width, self.config)
        return JpegImage(bytes(image_bytes), orientation, (height, width), resize_to, pad_to, grid)


def orient(chw: torch.Tensor, orientation: int) -> torch.Tensor:
    """uint8 [C, H, W] as stored -> as displayed: what ``PIL.ImageOps.exif_transpose`` does."""
    if orientation in (5, 6, 7, 8):
        chw = chw.transpose(1, 2)  # 5 = transpose; 6, 7, 8 = a transpose and a flip
        flips = {5: (), 6: (2,), 7: (1, 2), 8: (1,)}[orientation]
    else:
        flips = {1: (), 2: (2,), 3: (1, 2), 4: (1,)}[orientation]
    return chw.flip(flips) if flips else chw


def check_available(device: torch.device) -> None:
    """Raises BackendUnavailable, saying why, where nvJPEG decoding cannot run."""
    if device.type != "cuda":
        raise BackendUnavailable(f"decode nvjpeg needs a CUDA device; the model runs on {device}")
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except Exception as exc:  # ImportError, or a torchvision built for another torch
        raise BackendUnavailable(f"decode nvjpeg needs torchvision (torchvision.io.decode_jpeg on CUDA): "
                                 f"{type(exc).__name__}: {exc}") from None


def _torchvision_decode(files: torch.Tensor | list[torch.Tensor], device: torch.device):
    """``torchvision.io.decode_jpeg`` to RGB on ``device``: one file, or a list (one batched call)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg(files, mode=ImageReadMode.RGB, device=device)


# What decode_on_device calls; the CPU tests put a Pillow-backed stand-in here to exercise the path.
device_decode = _torchvision_decode


def _host_file(data: bytes | memoryview) -> torch.Tensor:
    """A JPEG file as the CPU tensor decode_jpeg reads. Request bytes are read-only (torch wants
    writable memory): a copy. A worker process's shared input buffer (engine/handoff.py) is
    writable and is not reused before the decode returns: read in place."""
    if isinstance(data, memoryview) and not data.readonly:
        return torch.frombuffer(data, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_on_device(items: Sequence[JpegImage], device: torch.device) -> list[torch.Tensor]:
    """Each JPEG decoded on ``device`` (one batched nvJPEG call) and oriented: uint8 [3, H, W].

    If the batched call fails, each file is decoded alone, so that one bad file fails alone:
    ``UndecodableInputs`` with indices into ``items``, also for a file whose pixels do not have the
    size its header gave (a header that lies must not reach the patchify with the wrong grid)."""
    files = [_host_file(item.data) for item in items]
    errors: dict[int, Exception] = {}
    try:
        images = list(device_decode(files, device))
    except RuntimeError:
        images = []
        for index, file in enumerate(files):
            try:
                images.append(device_decode(file, device))
            except RuntimeError as exc:
                images.append(None)
                errors[index] = InvalidInput(f"JPEG data could not be decoded on the device (nvJPEG): {exc}")
    out = []
    for index, (image, item) in enumerate(zip(images, items)):
        if image is None:
            continue
        image = orient(image, item.orientation)
        if tuple(image.shape) != (3, *item.size):
            errors[index] = InvalidInput(f"JPEG decoded on the device to {tuple(image.shape)} (channels, height, "
                                         f"width) where its header said (3, {item.size[0]}, {item.size[1]})")
        out.append(image)
    if errors:
        raise UndecodableInputs(errors)
    return out
