"""Images decoded in the device worker processes (``--devices``), not in the front end.

Why: Pillow's decode of a 1008x1008 JPEG costs ~10 ms of a core. In one front end serving several
GPUs, that work (under one process's GIL and scheduler, beside the streaming of every response)
capped a node near 100-140 images/s whatever its GPUs could do: the second GPU was two-thirds idle
and the third and fourth added nothing (bench/RESULTS.md). Each worker process decodes the images of
its own batches instead, on a thread pool of its own, while its device runs the batch before: the
decode capacity grows with the GPUs. vLLM drew the same lesson (multimodal preprocessing out of the
engine core, ``--api-server-count``).

The front end's half (``WorkerDecoder``) reads only the header, with every check of a full decode
(``decode.read_header``: pixel and memory limits, aspect ratio, JPEG scans, and the expensive-image
routing), and works out the grid from the displayed size with the family's ``geometry``. The file's
bytes cross in the worker's shared input buffer (``EncodedImage``), where the worker runs the
family's own decoder on them (``submit_decodes``), under the same time bound: the same function on
the same bytes, so the same pixels, and the cache namespace does not change.

What stays in the front end, decoded as before: formats other than JPEG and PNG (WebP, GIF), a PNG
whose orientation may follow its pixels, and every image the ordinary decode threads send to the
expensive-image pool (by its pixels or its JPEG scans): a worker holds its batch mates' work, so it
decodes only images whose cost the header bounds. An image whose decode fails in a worker fails
alone, with the error the front end would have given; its batch mates are encoded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidInput
from . import decode
from .decoders import image_decoder
from .staged import BytesPayload, DecodedImage, Grid


@dataclass(frozen=True, eq=False)
class EncodedImage(BytesPayload):
    """A JPEG's or PNG's bytes, for a worker process to decode with the family's decoder: the sizes
    the front end worked out from the header, and the limits the decode runs under there."""

    data: bytes | memoryview  # a view of the shared input buffer in the worker process
    resize_to: tuple[int, int]
    pad_to: tuple[int, int]
    grid: Grid
    max_image_pixels: int | None
    decode_seconds: float | None  # --max-decode-seconds (None: unbounded)


@dataclass(frozen=True)
class WorkerDecoder:
    """The front end's CPU half when workers decode: JPEG and PNG headers read here and the bytes
    handed on, anything else decoded here by ``fallback`` (the family's decoder). Only inside the
    ordinary decode threads' ``decode_budget`` (``decode.routing_expensive``): the expensive-image
    pool decodes here, as before."""

    fallback: Callable[[bytes, int | None], DecodedImage]  # models/base.py Decoder
    geometry: Callable[[int, int, object], tuple[tuple[int, int], tuple[int, int], Grid]]
    config: object
    decode_seconds: float | None

    def __call__(self, image_bytes: bytes, max_image_pixels: int | None = None) -> DecodedImage | EncodedImage:
        if not decode.routing_expensive():
            return self.fallback(image_bytes, max_image_pixels)
        header = decode.read_header(image_bytes, max_image_pixels)
        if header is None:
            return self.fallback(image_bytes, max_image_pixels)
        resize_to, pad_to, grid = self.geometry(header.height, header.width, self.config)
        return EncodedImage(image_bytes, resize_to, pad_to, grid, max_image_pixels, self.decode_seconds)


@dataclass
class Decoding:
    """The ``EncodedImage`` inputs of one batch decoding on a worker's pool (``submit_decodes``): the worker
    answers the batch ahead of it and launches it only once ``done``, so a slow file delays its own batch,
    not the one before."""

    inputs: list
    futures: dict[int, Future]  # by the input's index in the batch
    started: float

    def done(self) -> bool:
        return all(future.done() for future in self.futures.values())

    def wait(self, timeout_s: float | None = None) -> None:
        wait(list(self.futures.values()), timeout=timeout_s)

    def result(self) -> tuple[list, dict[int, Exception], float]:
        """The inputs with each file replaced by its ``DecodedImage`` (None where its decode failed), the
        error of each failed one by its index, and the wall seconds from submission to the last decode."""
        ready, failed, finished = list(self.inputs), {}, self.started
        for index, future in self.futures.items():
            try:
                ready[index], at = future.result()
                finished = max(finished, at)
            except Exception as exc:  # this image fails alone, with the error a front-end decode would give
                ready[index], failed[index] = None, exc
                finished = max(finished, time.perf_counter())
        return ready, failed, finished - self.started


def submit_decodes(inputs: Sequence, decoder: Callable[[bytes, int | None], DecodedImage],
                   pool: Executor, into: Callable[[int], np.ndarray | None] | None = None) -> Decoding | None:
    """The worker's half: every ``EncodedImage`` of ``inputs`` submitted to ``pool`` (Pillow releases the
    GIL) to be decoded by ``decoder``, each under its own time bound, a plain JPEG's pixels into
    ``into(nbytes)`` where that gives memory (``decode.decode_into``); None where there is none."""
    encoded = [index for index, item in enumerate(inputs) if isinstance(item, EncodedImage)]
    if not encoded:
        return None
    return Decoding(list(inputs), {index: pool.submit(_decode_one, inputs[index], decoder, into) for index in encoded},
                    time.perf_counter())


def _decode_one(item: EncodedImage, decoder: Callable[[bytes, int | None], DecodedImage],
                into: Callable[[int], np.ndarray | None] | None = None) -> tuple[DecodedImage, float]:
    with decode.decode_budget(item.decode_seconds), \
            (decode.decode_into(into) if into is not None else contextlib.nullcontext()):
        decoded = decoder(bytes(item.data), item.max_image_pixels)
    if tuple(decoded.grid) != tuple(item.grid) or tuple(decoded.resize_to) != tuple(item.resize_to):
        # The header promised other sizes than the pixels have: the batch was planned for the header's.
        raise InvalidInput(f"image decodes to grid {list(decoded.grid)}, its header said {list(item.grid)}")
    return decoded, time.perf_counter()


def decoding_in_workers(front, decode_seconds: float | None):
    """``front`` (models/base.py ``ModelFront``) with its decoder handing JPEGs and PNGs on to the workers;
    ``front`` itself where its decoder is not the family's CPU one with a geometry (a decoder on the
    device, or a stand-in that states no geometry): those decode as they did."""
    decoder = front.decoder
    geometry = getattr(decoder, "geometry", None)
    if geometry is None or image_decoder(front.decode).on_device:
        return front
    return dataclasses.replace(front, decoder=WorkerDecoder(decoder, geometry, decoder.config, decode_seconds))
