"""Real encoded images for the load: PNG and JPEG of several sizes, made with Pillow.

``ImageSource.miss()`` returns an image never returned before (a cache miss on the server);
``ImageSource.hit()`` returns one of a small fixed pool (cache hits once each was encoded). Misses
are cheap to make: a size's base picture is drawn once, and each miss stamps its serial number into
a corner before encoding, so the bytes (and the content hash) differ while encoding stays ~1 ms.
"""

from __future__ import annotations

import io
import itertools
import threading

import numpy as np
from PIL import Image

# (width, height): from the smallest the Qwen processor takes to its max_pixels on the tiny preset.
SIZES = ((56, 56), (112, 84), (224, 224), (336, 224), (448, 448))
FORMATS = ("JPEG", "PNG")


def base_picture(width: int, height: int, seed: int) -> np.ndarray:
    """A smooth picture with faint texture: PNG stays small and fast to encode (noise would make a
    448x448 PNG 450 KB and 25 ms), JPEG looks like a photo's."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.empty((height, width, 3), np.float32)
    for c in range(3):
        a, b = rng.uniform(0.01, 0.08, 2)
        img[..., c] = 128 + 90 * np.sin(a * xx + c) * np.cos(b * yy)
    img += np.round(rng.normal(0, 0.6, img.shape))  # mostly 0: PNG's filters still win
    return np.clip(img, 0, 255).astype(np.uint8)


def encode_picture(pixels: np.ndarray, fmt: str) -> bytes:
    out = io.BytesIO()
    if fmt == "PNG":
        Image.fromarray(pixels).save(out, "PNG", compress_level=1)
    else:
        Image.fromarray(pixels).save(out, fmt, quality=90)
    return out.getvalue()


class ImageSource:
    """Thread-safe maker of hit and miss images; ``seed`` separates the images of two sources."""

    def __init__(self, seed: int = 0, sizes=SIZES, formats=FORMATS, hit_pool: int = 12) -> None:
        self._bases = {size: base_picture(*size, seed=seed * 1000 + i) for i, size in enumerate(sizes)}
        self._sizes = list(sizes)
        self._formats = list(formats)
        self._seed = seed
        self._serial = itertools.count()
        self._lock = threading.Lock()
        self.hits = [self._make(n) for n in range(hit_pool)]  # serials 0.. are the hit pool
        self._next_hit = itertools.count()
        with self._lock:
            for _ in range(hit_pool):
                next(self._serial)

    def _make(self, serial: int) -> bytes:
        size = self._sizes[serial % len(self._sizes)]
        fmt = self._formats[(serial // len(self._sizes)) % len(self._formats)]
        pixels = self._bases[size].copy()
        # The stamp: seed and serial as bytes in the first row (distinct content, distinct hash).
        stamp = np.frombuffer(int(self._seed).to_bytes(4, "little") + int(serial).to_bytes(8, "little"),
                              np.uint8)
        pixels[0, : len(stamp), 0] = stamp
        pixels[1:8, :32] = (serial * 37) % 256  # survives JPEG's rounding of a single row
        return encode_picture(pixels, fmt)

    def miss(self) -> bytes:
        with self._lock:
            serial = next(self._serial)
        return self._make(serial)

    def hit(self) -> bytes:
        return self.hits[next(self._next_hit) % len(self.hits)]

    def misses(self, n: int) -> list[bytes]:
        return [self.miss() for _ in range(n)]
