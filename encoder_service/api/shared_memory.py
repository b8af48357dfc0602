"""Embeddings written into shared memory instead of the stream: a caller's region
(EncodeRequest.output_region, ``--shared-memory on``) or a relay process's (api/relay/regions.py).
A caller's region named in /dev/shm is written here (``RegionTable``, ``DescriptorWriter``); one it
registered by descriptor, which the server maps, in api/caller_regions.py (``RegionWriter``, as a
relay's). ``encoder_client`` registers where the server offers it, and names a /dev/shm object
otherwise.

A caller on the server's host creates a POSIX shared-memory object (/dev/shm/encoder-...), names it
in its request and reads each image where the stream's header chunk says. Moving a 1008x1008
image's 8.8 MB embedding through gRPC costs ~10 ms of copies and framing on loopback; through the
region it is one copy on each side. The same idea as Triton's system shared-memory outputs, without
a registration call: the name travels with the request.

A caller's object is written with ``pwrite`` into a descriptor opened for that call, never through
a mapping: the caller owns the object and can shrink it at any moment, and a write through a
mapping past its new end would kill the server with SIGBUS. A shrunk object is that caller's error
(checked before each image), and the server takes nothing but the pages the call's own images
fill (no reservation of the size the object claims). ``pwrite`` costs about twice a copy into a
mapping (2.2 against 1.1 ms for 9.3 MB on the CPU it was measured on) and runs in the response-copy
threads without the GIL.

The server only writes into objects whose name starts with ``encoder-``, only with
``--shared-memory on``, and only when the object's first bytes equal the request's
``output_region.key``: a name in /dev/shm is listable by every user of the host, the object's
bytes only by its owner (mode 0600), so a caller cannot have the server write into another user's
region, whatever name it puts in its request. Images go from offset 64 on: the key stays. What this
cannot stop: a process of the object owner's own user, which may read the object anyway (README,
"Threat model"). Errors never echo a region's name.
"""

from __future__ import annotations

import hmac
import os
import re
import stat

import numpy as np
from encoder_client.protocol import encoder_pb2
from encoder_client.shared_memory import copy_in_slices

from ..errors import EncoderError, InvalidInput, PermissionDenied

SHM_DIR = "/dev/shm"
NAME_PATTERN = re.compile(r"encoder-[A-Za-z0-9._-]{1,200}")
# Names earlier releases gave the relays' regions; they have none now (api/relay/regions.py), and a
# caller's region may not pose as one.
RESERVED_PREFIX = "encoder-relay-"
ALIGN = 64  # each image starts on a cache line: the reader's copy out is aligned
KEY_BYTES = (16, 64)  # output_region.key's length; the object's first 64 bytes are the owner's
FIRST_OFFSET = 64


class RegionUnusable(EncoderError):
    """The region cannot be used by this server (off, not on this host, not writable, shrunk)."""

    code = "FAILED_PRECONDITION"


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class RegionTable:
    """Opens the regions callers name, one descriptor per call."""

    def __init__(self, enabled: bool, directory: str = SHM_DIR) -> None:
        self.enabled = enabled
        self._directory = directory
        # The filesystem the directory holds: an object on another (a file or FUSE mounted under a
        # name, by a user who can mount) would have the server read and write elsewhere.
        try:
            self._device: int | None = os.stat(directory).st_dev
        except OSError:
            self._device = None

    def writer(self, region: encoder_pb2.SharedMemoryRegion) -> DescriptorWriter:
        """A writer for one call into ``region``; raises a clear error when it cannot be used."""
        if not self.enabled:
            raise RegionUnusable("output_region: this server does not write to shared memory (start it "
                                 "with --shared-memory on); leave output_region unset to get the "
                                 "embeddings on the stream")
        name = region.name
        if not NAME_PATTERN.fullmatch(name) or name.startswith(RESERVED_PREFIX):
            raise InvalidInput("output_region.name is not 'encoder-' followed by at most 200 letters, digits, "
                               f"'.', '_' or '-' (and not starting with {RESERVED_PREFIX!r})")
        if not KEY_BYTES[0] <= len(region.key) <= KEY_BYTES[1]:
            raise InvalidInput(f"output_region.key is {len(region.key)} bytes; it must be {KEY_BYTES[0]} to "
                               f"{KEY_BYTES[1]} bytes that the region's creator also wrote at its start "
                               "(encoder_client's regions do)")
        if len(set(region.key)) == 1:
            # A key of one repeated byte is what an object holds before its creator wrote one.
            raise InvalidInput("output_region.key is one byte repeated; it must be random bytes its creator "
                               "wrote at the region's start before giving the region a size")
        if region.size <= FIRST_OFFSET:
            raise InvalidInput(f"output_region.size {region.size} leaves no room after its first {FIRST_OFFSET} bytes")
        path = os.path.join(self._directory, name)
        try:
            # O_NONBLOCK: a FIFO planted under the name must not block the open.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise RegionUnusable("output_region does not exist on the server's host: shared memory needs "
                                 "the caller on the server's host, sharing its /dev/shm") from None
        except OSError as err:
            raise RegionUnusable(f"output_region: the server cannot open it ({err.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RegionUnusable("output_region is not a shared-memory object")
            if st.st_dev != self._device:
                raise RegionUnusable("output_region is not on the server's /dev/shm (another filesystem is "
                                     "mounted under its name)")
            if region.size > st.st_size:
                raise InvalidInput(f"output_region.size {region.size} is larger than the object ({st.st_size} bytes)")
            if not hmac.compare_digest(os.pread(fd, len(region.key), 0), region.key):
                raise PermissionDenied("output_region's first bytes are not its key: the server writes only "
                                       "into a region its caller created")
        except OSError as err:
            os.close(fd)
            raise RegionUnusable(f"output_region: the server cannot read it ({err.strerror})") from None
        except BaseException:
            os.close(fd)
            raise
        return DescriptorWriter(fd, region.size)


class RegionWriter:
    """Places one call's images one after another in a region mapped by the server (a relay's
    sealed region, which cannot shrink)."""

    def __init__(self, memory: np.ndarray) -> None:
        self._memory = memory
        self._next = 0

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit (``place`` then writes them into the region)."""
        return self._next + nbytes <= len(self._memory)

    def place(self, data: memoryview | bytes) -> tuple[int, int] | None:
        """Copies ``data`` into the region; (offset, length), or None when it does not fit (the
        image then goes on the stream)."""
        src = np.frombuffer(data, np.uint8)
        offset = self._next
        if not self.fits(len(src)):
            return None
        # numpy releases the GIL for a copy this size: the decode threads and the device worker
        # go on meanwhile. Several megabytes go in pieces at once (one thread copies at a fraction
        # of the host's memory bandwidth).
        memory = self._memory

        def copy(start: int, stop: int) -> None:
            memory[offset + start:offset + stop] = src[start:stop]

        copy_in_slices(len(src), 1, copy)
        self._next = _aligned(offset + len(src))
        return offset, len(src)


class DescriptorWriter:
    """Places one call's images in a caller's object with ``pwrite`` (see the module docstring).

    The descriptor is closed when the writer is collected, not when the call's handler returns: a
    response-copy thread may still be writing then, and a descriptor closed under it could be
    reused by another open before its ``pwrite``."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self._size = size
        self._next = FIRST_OFFSET  # the owner's key lies before

    def __del__(self) -> None:
        os.close(self._fd)

    def place(self, data: memoryview | bytes) -> tuple[int, int] | None:
        src = np.frombuffer(data, np.uint8)
        offset = self._next
        if offset + len(src) > self._size:
            return None
        now = os.fstat(self._fd).st_size
        if now < offset + len(src):
            # Shrunk by its owner while the call ran; pwrite would grow it back, but the caller
            # broke its own region: tell it.
            raise RegionUnusable(f"output_region shrank to {now} bytes while the call ran (it was declared "
                                 f"{self._size})")
        view = memoryview(src)
        done = 0
        while done < len(src):  # os.pwrite releases the GIL
            try:
                done += os.pwrite(self._fd, view[done:], offset + done)
            except OSError as err:  # a full /dev/shm: ENOSPC
                raise RegionUnusable(f"output_region: the server cannot write it ({err.strerror})") from None
        self._next = _aligned(offset + len(src))
        return offset, len(src)
