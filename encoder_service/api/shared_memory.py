"""Embeddings written into a caller's shared-memory region (EncodeRequest.output_region).

A caller on the server's host creates a POSIX shared-memory object (/dev/shm/encoder-...), names it
in its request and reads each image where the stream's header chunk says. Moving a 1008x1008
image's 8.8 MB embedding through gRPC costs ~10 ms of copies and framing on loopback; through the
region it is one copy on each side. The same idea as Triton's system shared-memory outputs, without
a registration call: the name travels with the request, and the mapping is kept for the next call.

The server only writes into objects whose name starts with ``encoder-`` and only with
``--shared-memory on``: a request names the object, so every caller that can reach the port must be
trusted with that host's ``/dev/shm/encoder-*``.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from encoder_client.protocol import encoder_pb2

from ..errors import EncoderError, InvalidInput

SHM_DIR = "/dev/shm"
NAME_PATTERN = re.compile(r"encoder-[A-Za-z0-9._-]{1,200}")
ALIGN = 64  # each image starts on a cache line: the reader's copy out is aligned
# Mappings kept between calls (a client reuses its regions); beyond it the least recently used is
# dropped (unmapped once no call writes into it).
MAX_OPEN_REGIONS = 64


class RegionUnusable(EncoderError):
    """The region cannot be used by this server (off, not on this host, not writable)."""

    code = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class _Mapping:
    identity: tuple[int, int, int]  # (device, inode, size) of the object it maps
    memory: np.ndarray  # uint8 view of the whole mapping


class RegionTable:
    """The regions callers named, mapped once and reused while the object behind the name stays
    the same (same inode and size; a re-created object is mapped again)."""

    def __init__(self, enabled: bool, directory: str = SHM_DIR, capacity: int = MAX_OPEN_REGIONS,
                 trusted_prefix: str = "") -> None:
        self.enabled = enabled
        # The relay processes' regions (api/relay.py): their names carry a secret of this server's
        # start, so they are written even with --shared-memory off, and no caller can name one.
        self._trusted_prefix = trusted_prefix
        self._directory = directory
        self._capacity = capacity
        self._open: OrderedDict[str, _Mapping] = OrderedDict()

    def writer(self, region: encoder_pb2.SharedMemoryRegion) -> RegionWriter:
        """A writer for one call into ``region``; raises a clear error when it cannot be used."""
        trusted = bool(self._trusted_prefix) and region.name.startswith(self._trusted_prefix)
        if not self.enabled and not trusted:
            raise RegionUnusable("output_region: this server does not write to shared memory (start it "
                                 "with --shared-memory on); leave output_region unset to get the "
                                 "embeddings on the stream")
        name = region.name
        if not NAME_PATTERN.fullmatch(name):
            raise InvalidInput(f"output_region.name {name[:64]!r} is not 'encoder-' followed by at most "
                               "200 letters, digits, '.', '_' or '-'")
        if region.size == 0:
            raise InvalidInput("output_region.size is 0")
        return RegionWriter(name, self._map(name, region.size)[:region.size])

    def _map(self, name: str, size: int) -> np.ndarray:
        path = os.path.join(self._directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            self._open.pop(name, None)
            raise RegionUnusable(f"output_region {name!r} does not exist on the server's host ({path}): "
                                 "shared memory needs the caller on the server's host, sharing its "
                                 "/dev/shm") from None
        except OSError as err:
            raise RegionUnusable(f"output_region {name!r}: the server cannot open {path}: "
                                 f"{err.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RegionUnusable(f"output_region {name!r} is not a shared-memory object")
            if size > st.st_size:
                raise InvalidInput(f"output_region.size {size} is larger than {name!r} ({st.st_size} bytes)")
            identity = (st.st_dev, st.st_ino, st.st_size)
            known = self._open.get(name)
            if known is not None and known.identity == identity:
                self._open.move_to_end(name)
                return known.memory
            try:
                # A sparse object (a page tmpfs cannot give) would kill this process with SIGBUS on
                # the write; reserved now, it fails here, as an answer. A no-op for the client's
                # regions, which reserve their pages when created.
                os.posix_fallocate(fd, 0, st.st_size)
            except OSError as err:
                raise RegionUnusable(f"output_region {name!r}: cannot reserve its {st.st_size} bytes "
                                     f"({err.strerror})") from None
            memory = np.frombuffer(mmap.mmap(fd, st.st_size, mmap.MAP_SHARED), np.uint8)
        finally:
            os.close(fd)
        self._forget_unlinked()
        self._open[name] = _Mapping(identity, memory)
        while len(self._open) > self._capacity:
            # Dropped, not closed: a call still writing holds its own reference to the view.
            self._open.popitem(last=False)
        return memory

    def _forget_unlinked(self) -> None:
        """Drops the mappings of objects unlinked (or replaced) since: a client discards a region
        whose call failed, and its memory lives as long as a mapping does. Run when a new region is
        mapped, which is rare (clients reuse theirs)."""
        for name, known in list(self._open.items()):
            try:
                st = os.stat(os.path.join(self._directory, name), follow_symlinks=False)
                if (st.st_dev, st.st_ino, st.st_size) == known.identity:
                    continue
            except OSError:
                pass
            del self._open[name]

    def __len__(self) -> int:
        return len(self._open)


class RegionWriter:
    """Places one call's images one after another in its region."""

    def __init__(self, name: str, memory: np.ndarray) -> None:
        self.name = name
        self._memory = memory
        self._next = 0

    def place(self, data: memoryview | bytes) -> tuple[int, int] | None:
        """Copies ``data`` into the region; (offset, length), or None when it does not fit (the
        image then goes on the stream)."""
        src = np.frombuffer(data, np.uint8)
        offset = self._next
        if offset + len(src) > len(self._memory):
            return None
        # numpy releases the GIL for a copy this size: the decode threads and the device worker
        # go on meanwhile.
        self._memory[offset:offset + len(src)] = src
        self._next = -(-(offset + len(src)) // ALIGN) * ALIGN
        return offset, len(src)
