"""Keeping the process's resident memory close to what it holds (glibc's allocator).

Decode threads and the device worker allocate and free megabytes per image. glibc gives every
thread that allocates its own arena (up to 8 per core) and keeps freed memory inside them, so after
a burst the server's RSS stays hundreds of MiB above what it uses, for good. Two remedies, both no-ops
where the C library is not glibc: fewer arenas (set at start-up, before the threads exist), and
``malloc_trim`` once the server has gone idle, which hands the free pages back to the kernel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # mallopt parameter number, from glibc's malloc.h
MALLOC_ARENAS = 4


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


def release_free_memory() -> bool:
    """Returns the allocator's free pages to the kernel (takes milliseconds; call it when idle)."""
    return _LIBC is not None and _LIBC.malloc_trim(0) == 1
