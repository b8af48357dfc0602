"""Keeping the process's resident memory close to what it holds (glibc's allocator).

Decode threads and the device worker allocate and free megabytes per image. glibc gives every
thread that allocates its own arena (up to 8 per core) and keeps freed memory inside them, so after
a burst the server's RSS stays hundreds of MiB above what it uses, for good. Two remedies, both no-ops
where the C library is not glibc: fewer arenas (set at start-up, before the threads exist), and
``malloc_trim`` once the server has gone idle, which hands the free pages back to the kernel.

The other way round, under load: every streamed response is megabytes of new buffers (each chunk
message, and gRPC's own copy of it). By default glibc serves blocks from 128 KiB up with a fresh
``mmap`` and unmaps them when freed, and trims the heap's top as soon as a few MiB there are free,
so every such buffer is new memory that the kernel zeroes and maps page by page as the copy
touches it. ``keep_large_blocks_in_heap`` serves blocks up to 32 MiB from the heap and keeps up to
128 MiB of free heap mapped; the idle and periodic trims above still hand it back. Measured with
gRPC alone streaming 9.3 MB embeddings (bench/RESULTS.md): 223 -> 336 images/s from 32 streams on
the 16-core H100 host, and 100 -> 160 from one stream on 2 cores.

Decoded images: Pillow allocates each image's pixels in blocks (up to 16 MiB each) and, by default,
frees them when the image goes. ``keep_image_blocks`` turns on Pillow's cache of freed blocks (its
documented block allocator, ``PILLOW_BLOCKS_MAX``), so the next decode writes into memory already
mapped: a 1008x1008 JPEG's decode took 6.0 ms instead of 8.3 on a 16-core H200 host, and 8.2 instead
of 9.8 ms right after a trim; on a 2-core host the same warm, 10.8 instead of 11.9 ms after a trim
(bench/decode_memory.py, bench/RESULTS.md). A trim keeps a few of them (``IMAGE_BLOCKS_KEPT_IDLE``):
a lone request after an idle spell is what an interactive caller sends.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

from PIL import Image

log = logging.getLogger(__name__)

# mallopt parameter numbers, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MALLOC_ARENAS = 4
HEAP_BLOCK_MAX = 32 << 20  # glibc's largest mmap threshold on 64 bits (HEAP_MAX_SIZE / 2)
HEAP_FREE_KEPT = 128 << 20
# Freed image blocks Pillow keeps (each at most its 16 MiB block size): under load, and after a trim.
IMAGE_BLOCKS_KEPT = 8
IMAGE_BLOCKS_KEPT_IDLE = 2


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # glibc only: musl and others have no arenas to tune  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def limit_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """At most ``arenas`` malloc arenas for threads started from now on; True where it took effect."""
    return _LIBC is not None and _LIBC.mallopt(_M_ARENA_MAX, arenas) == 1


def keep_large_blocks_in_heap(block_max: int = HEAP_BLOCK_MAX, free_kept: int = HEAP_FREE_KEPT) -> bool:
    """Blocks up to ``block_max`` bytes come from the heap, and up to ``free_kept`` bytes of free
    heap stay mapped between trims (see the module docstring); True where it took effect."""
    return (_LIBC is not None and _LIBC.mallopt(_M_MMAP_THRESHOLD, block_max) == 1
            and _LIBC.mallopt(_M_TRIM_THRESHOLD, free_kept) == 1)


_image_blocks_ours = False  # whether keep_image_blocks set Pillow's cache (not PILLOW_BLOCKS_MAX)


def keep_image_blocks(blocks: int = IMAGE_BLOCKS_KEPT) -> bool:
    """Pillow keeps up to ``blocks`` freed image blocks for the next decodes (module docstring),
    unless PILLOW_BLOCKS_MAX already says how many; True where this call set it."""
    global _image_blocks_ours
    if "PILLOW_BLOCKS_MAX" in os.environ:
        return False
    Image.core.set_blocks_max(blocks)
    _image_blocks_ours = True
    return True


def release_free_memory() -> bool:
    """Returns the allocator's free pages to the kernel, and Pillow's cached image blocks beyond
    ``IMAGE_BLOCKS_KEPT_IDLE`` where ``keep_image_blocks`` set the cache (PILLOW_BLOCKS_MAX's is the
    operator's); takes milliseconds: call it when idle."""
    if _image_blocks_ours:
        Image.core.clear_cache(IMAGE_BLOCKS_KEPT_IDLE)
    return _LIBC is not None and _LIBC.malloc_trim(0) == 1


@functools.cache
def host_has_swap() -> bool:
    """Whether this host can swap (``SwapTotal`` in /proc/meminfo above 0; True where it cannot be read):
    where it can, a page of shared memory that a caller alone has mapped may be out on disk when the
    server writes it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("SwapTotal:"):
                    return int(line.split()[1]) > 0
    except (OSError, ValueError, IndexError):
        pass
    return True
