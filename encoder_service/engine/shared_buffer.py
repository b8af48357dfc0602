"""Anonymous shared memory between the front end and a worker process.

A buffer is a ``memfd`` (an unnamed file in RAM) mapped into both processes: the front end creates
it and hands the worker its file descriptor over their pipe, so nothing is ever named in /dev/shm
and nothing outlives the two processes, however they end. Only CPU memory crosses the process
boundary (a CUDA tensor sent to another process would make it open a context on the sender's GPU).
"""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np

_PAGE = mmap.PAGESIZE


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class SharedBuffer:
    """A fixed-size read/write mapping of a memfd, viewed as numpy uint8."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self._map = mmap.mmap(fd, size)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def create(cls, size: int, name: str = "encoder-service") -> SharedBuffer:
        size = _round_up(max(size, 1), _PAGE)
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, size: int) -> SharedBuffer:
        """Maps a buffer whose descriptor another process sent us (we own that descriptor now)."""
        return cls(fd, size)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset:offset + nbytes]

    def close(self) -> None:
        self.array = None  # numpy's view holds an export of the map: drop it before closing
        with contextlib.suppress(BufferError):  # a view still lives: the mapping goes with it
            self._map.close()
        os.close(self.fd)


def grown(buffer: SharedBuffer | None, needed: int) -> SharedBuffer | None:
    """None when ``buffer`` holds ``needed`` bytes, else a new buffer (twice as large as asked,
    so a growing stream of batch sizes settles after a few steps)."""
    if buffer is not None and buffer.size >= needed:
        return None
    return SharedBuffer.create(max(needed * 2, 1 << 20))
