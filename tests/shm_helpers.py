"""What the shared-memory tests share (tests/api/test_shared_memory.py, test_caller_regions.py): new
images, and this process's /dev/shm objects."""

from __future__ import annotations

import io
import os

import numpy as np
from encoder_client.shared_memory import SHM_DIR
from PIL import Image


def png(seed: int, size=(150, 100)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def our_objects() -> set[str]:
    """The /dev/shm objects this process's clients created (registered regions leave none)."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"encoder-{os.getpid()}-")}
