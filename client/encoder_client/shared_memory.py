"""Shared-memory regions the server writes embeddings into, for a client on the server's host.

With ``EncoderClient(..., shared_memory=True)`` each Encode call lends the server one region, a
POSIX shared-memory object this process created (``/dev/shm/encoder-<pid>-<random>``), and the
server writes each image's rows there instead of streaming them (EncodeRequest.output_region; the
server needs ``--shared-memory on``). The client copies each image out into its own array as its
header chunk arrives, so a region is free again when the call returns.

Regions are pooled (a call in flight holds one) and kept mapped: reusing one costs neither page
faults nor a new mapping on either side. A region starts at ``initial_bytes`` and grows to what the
largest call needed (an image that does not fit still arrives, on the stream). A region whose call
failed is unlinked instead of reused: the server may still be writing into it. Regions are unlinked
at ``close()`` and at interpreter exit; a process killed outright leaves its objects in /dev/shm.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
import weakref

import numpy as np

from encoder_client.protocol import encoder_pb2

SHM_DIR = "/dev/shm"
NAME_PREFIX = "encoder-"  # the server writes only into objects named so
DEFAULT_INITIAL_BYTES = 16 << 20
ALIGN = 64  # the server's alignment of each image in a region
_GROW_STEP = 1 << 20


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class OutputRegion:
    """One shared-memory object of this process, mapped read/write, unlinked by ``close()``."""

    def __init__(self, size: int, directory: str = SHM_DIR, prefix: str = NAME_PREFIX) -> None:
        if size <= 0:
            raise ValueError(f"a shared-memory region needs a positive size, got {size}")
        self.name = f"{prefix}{os.getpid()}-{secrets.token_hex(8)}"
        self.size = size
        path = os.path.join(directory, self.name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            self._finalizer = weakref.finalize(self, _unlink, path)
            try:
                # Reserve the pages now: on a full /dev/shm the error is ours, here, and not a
                # SIGBUS in whichever process first writes past what tmpfs could give.
                os.posix_fallocate(fd, 0, size)
            except OSError as err:
                self._finalizer()
                raise OSError(err.errno, f"cannot reserve {size} bytes of shared memory in {directory} "
                                         f"({err.strerror}); a container's /dev/shm may be too small") from None
            self.memory = np.frombuffer(mmap.mmap(fd, size, mmap.MAP_SHARED), np.uint8)
        finally:
            os.close(fd)

    def proto(self) -> encoder_pb2.SharedMemoryRegion:
        return encoder_pb2.SharedMemoryRegion(name=self.name, size=self.size)

    def view(self, offset: int, length: int) -> np.ndarray | None:
        """Bytes [offset, offset + length) of the region, or None if they are not all inside it."""
        if offset < 0 or length < 0 or offset + length > self.size:
            return None
        return self.memory[offset:offset + length]

    def close(self) -> None:
        """Unlinks the object; the mapping goes with the last view of it."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class RegionPool:
    """Regions for concurrent calls (one each), thread-safe; grows a region a call outgrew."""

    def __init__(self, initial_bytes: int = DEFAULT_INITIAL_BYTES, directory: str = SHM_DIR,
                 prefix: str = NAME_PREFIX) -> None:
        if initial_bytes <= 0:
            raise ValueError(f"shared_memory_bytes must be positive, got {initial_bytes}")
        if not prefix.startswith(NAME_PREFIX):
            raise ValueError(f"a region's name must start with {NAME_PREFIX!r}, got the prefix {prefix!r}")
        self.region_bytes = initial_bytes
        self._directory = directory
        self._prefix = prefix
        self._free: list[OutputRegion] = []
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self) -> OutputRegion:
        with self._lock:
            if self._closed:
                raise ValueError("the client is closed")
            while self._free:
                region = self._free.pop()
                if region.size >= self.region_bytes:
                    return region
                region.close()  # outgrown by an earlier call
            size = self.region_bytes
        return OutputRegion(size, self._directory, self._prefix)

    def release(self, region: OutputRegion, *, needed_bytes: int, failed: bool) -> None:
        """Back to the pool after its call; ``needed_bytes``: what the call's images took (those that
        came on the stream included), so the next region holds them all."""
        with self._lock:
            if needed_bytes > self.region_bytes:
                self.region_bytes = -(-needed_bytes // _GROW_STEP) * _GROW_STEP
            if failed or self._closed or region.size < self.region_bytes:
                region.close()
            else:
                self._free.append(region)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for region in free:
            region.close()

