"""Host memory already mapped, for the copies of embeddings that the cache keeps.

Every embedding leaves the device's pinned output (or a worker process's shared buffer) through a
copy into memory of its own, which the cache then keeps. That copy sits on every request's path,
between the forward and the response. While the cache is still filling, its destination is new
memory: the kernel maps and zeroes it page by page as the copy first touches it. On a 2-core host
the copy of a 1008x1008 image's 8.8 MB embedding took 2.6 ms that way, and 0.12 ms into memory
already mapped (a 448x448 image's 1.8 MB: 0.46 against 0.02 ms).

``WarmBuffers`` keeps a few buffers of each size asked for lately, their pages touched beforehand
by a thread of its own, so that the next copy of that size lands in mapped memory: the page
faults move off the request's path. After each copy the thread prepares one buffer of its size (a
batch's copies as many), so the pool fills up to ``per_size`` of a size only as that size recurs.
A miss (a size not seen lately, or the thread behind) is a plain ``clone``, as before.

The same for the pixels a JPEG decodes to (``DECODE_BUFFERS``, ``take_array``): a lone image after an
idle spell, when the server has given its free memory back, decoded into new memory (a 1008x1008
photo's 3 MB: 7.96 against 6.22 ms on an H200 host's core, bench/RESULTS.md).

Bounded: at most ``max_bytes`` held or being prepared (64 MiB by default), at most ``per_size``
buffers of one size, only sizes of at most half of ``max_bytes``; the sizes asked for least
recently give way first. A buffer handed out is the caller's (the cache's) for good: exactly its
size, never handed out twice.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 << 20
# A batch of a few images of one size (a lone image, a burst of equal photos) is served warm; more
# wait for the thread or miss.
DEFAULT_PER_SIZE = 4


class WarmBuffers:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, per_size: int = DEFAULT_PER_SIZE) -> None:
        self.max_bytes = int(max_bytes)
        self.per_size = int(per_size)
        self._lock = threading.Lock()
        self._free: OrderedDict[int, list[torch.Tensor]] = OrderedDict()  # size -> buffers, recent sizes last
        self._filling: dict[int, int] = {}  # size -> buffers the thread is preparing
        self._held = 0  # bytes in _free and being prepared
        self._thread: ThreadPoolExecutor | None = None
        self.hits = 0
        self.misses = 0
        self.prepared = 0  # buffers the thread has made

    @property
    def held_bytes(self) -> int:
        return self._held

    def copies(self, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each CPU tensor copied into memory of its own (warm where a buffer of its size is ready),
        then the buffers taken replaced in the background."""
        out = [self._copy(part) for part in parts]
        self._refill(Counter(int(part.nbytes) for part in parts if _fits(part)))
        return out

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 buffer of exactly ``nbytes`` whose pages are mapped, if one is ready (None: the caller
        uses new memory), and one more of that size ordered for the next caller: for memory that
        something other than ``copies`` fills (a decode)."""
        buffer = self._take(nbytes)  # never one of a size _refill does not make (none, or over half the bound)
        self._refill(Counter({nbytes: 1}))
        return buffer

    def take_array(self, nbytes: int) -> np.ndarray | None:
        """``take`` as a writable numpy array over the buffer (``decode.decode_into``'s ``take``)."""
        buffer = self.take(nbytes)
        return None if buffer is None else buffer.numpy()

    def _copy(self, part: torch.Tensor) -> torch.Tensor:
        buffer = self._take(int(part.nbytes)) if _fits(part) else None
        if buffer is None:
            return part.clone()
        out = buffer.view(part.dtype).view(part.shape)
        out.copy_(part)
        return out

    def _take(self, nbytes: int) -> torch.Tensor | None:
        with self._lock:
            buffers = self._free.get(nbytes)
            if not buffers:
                self.misses += 1
                return None
            self.hits += 1
            self._held -= nbytes
            return buffers.pop()

    def _refill(self, taken: Counter) -> None:
        """Orders the thread to prepare as many buffers of each size as the copies just made (up to
        ``per_size`` of a size, within the bound): its work is at most the page faults those copies
        would have taken themselves, whatever sizes a caller makes the server produce."""
        orders, dropped = [], []
        with self._lock:
            for nbytes, copies in taken.items():
                if nbytes == 0 or nbytes > self.max_bytes // 2:
                    continue
                self._free.setdefault(nbytes, [])
                self._free.move_to_end(nbytes)
                missing = min(copies, self.per_size - len(self._free[nbytes]) - self._filling.get(nbytes, 0))
                count = 0
                while count < missing and self._room_for(nbytes, dropped):
                    self._held += nbytes
                    count += 1
                if count:
                    self._filling[nbytes] = self._filling.get(nbytes, 0) + count
                    orders.append((nbytes, count))
            if orders and self._thread is None:
                self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="warm-memory")
        del dropped  # freed outside the lock
        for nbytes, count in orders:
            try:
                self._thread.submit(self._prepare, nbytes, count)
            except RuntimeError:  # the interpreter is shutting down: no more buffers, nothing owed
                self._give_back(nbytes, count)

    def _room_for(self, nbytes: int, dropped: list) -> bool:
        """Whether ``nbytes`` more fit, dropping buffers (into ``dropped``) of the least recently
        asked sizes other than ``nbytes`` itself to make room (under the lock)."""
        for size in list(self._free):
            if self._held + nbytes <= self.max_bytes:
                break
            if size == nbytes:
                continue
            buffers = self._free[size]
            while buffers and self._held + nbytes > self.max_bytes:
                dropped.append(buffers.pop())
                self._held -= size
            if not buffers and not self._filling.get(size):
                del self._free[size]
        return self._held + nbytes <= self.max_bytes

    def _prepare(self, nbytes: int, count: int) -> None:
        made = 0
        try:
            for _ in range(count):
                buffer = torch.empty(nbytes, dtype=torch.uint8)
                # One write per page maps it (the fill runs without the GIL); the last byte's page too.
                buffer[::mmap.PAGESIZE].fill_(0)
                buffer[-1:].fill_(0)
                with self._lock:
                    # A size being prepared keeps its entry (trim and _room_for leave it).
                    self._free[nbytes].append(buffer)
                    self.prepared += 1
                    made += 1
                    self._filled(nbytes, 1)
        except Exception as exc:  # out of memory: the copies go on as plain clones
            log.warning("could not prepare a warm %d-byte buffer: %s: %s", nbytes, type(exc).__name__, exc)
        finally:
            if made < count:
                self._give_back(nbytes, count - made)

    def _filled(self, nbytes: int, count: int) -> None:
        """``count`` of the buffers being prepared of this size are done or given up (under the lock)."""
        self._filling[nbytes] -= count
        if not self._filling[nbytes]:
            del self._filling[nbytes]
            if not self._free.get(nbytes, True):
                del self._free[nbytes]

    def _give_back(self, nbytes: int, count: int) -> None:
        """The room reserved for ``count`` buffers that will not be made."""
        with self._lock:
            self._held -= nbytes * count
            self._filled(nbytes, count)

    def trim(self) -> None:
        """Keeps only the buffers of the size asked for last (the server's trims call it: the
        next lone request is most likely of that size)."""
        dropped = []
        with self._lock:
            for size in list(self._free)[:-1]:
                self._held -= size * len(self._free[size])
                dropped.extend(self._free[size])
                self._free[size].clear()
                if not self._filling.get(size):
                    del self._free[size]
        del dropped  # freed outside the lock

    def drain(self) -> None:
        """Waits for the buffers being prepared (tests)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.submit(lambda: None).result()


def _fits(part: torch.Tensor) -> bool:
    """Whether a buffer of bytes can take this tensor as a plain view (a CPU tensor, contiguous)."""
    return part.device.type == "cpu" and part.is_contiguous()


# The process's one pool: the device worker's thread and the threads that copy out of worker
# processes' buffers share it.
HOST_COPIES = WarmBuffers()
# The decode threads' pixels (a 1008x1008 image's 3 MB, four of a size; images over 16 MiB of pixels,
# which the model resizes down anyway, decode into new memory).
DECODE_BUFFERS = WarmBuffers(max_bytes=32 << 20)


def trim() -> None:
    """Every pool down to the size asked for last (the server's and a worker process's idle trims)."""
    HOST_COPIES.trim()
    DECODE_BUFFERS.trim()
