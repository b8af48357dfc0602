"""The thread pools of an image's CPU half: hashing a request's images, decoding ordinary images,
and decoding images that are expensive by their header in a pool of their own (so ordinary images
never queue behind them). The engine decides what preparing an image means; this decides where it
runs, how many expensive ones may wait, and who is next: the ordinary threads go to callers in turn
(``FairSlots``), so one caller's flood of large images never queues another caller's image behind all
of it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ..errors import RETRY_AFTER_S, ResourceExhausted
from ..offload import run_to_the_end
from ..preprocess import decode
from .fair_slots import Caller, FairSlots

# Requests up to this size are hashed on the event loop; larger ones in the hash pool, since sha256
# releases the GIL and the loop would otherwise sit idle while it runs.
HASH_INLINE_BYTES = 64 * 1024
HASH_THREADS = 2  # sha256 releases the GIL: two threads keep large requests off the loop
# Images expensive to decode by their header (decode.ExpensiveImage: a JPEG with more scans than
# encoders write, or more pixels than the derived default limit) decode in a pool of their own: one
# thread for every 4 decode threads (at least one), so they take at most that share of the decoding
# CPU and never hold up an ordinary image. At most this many per thread are decoding or waiting;
# beyond that RESOURCE_EXHAUSTED (retry later).
EXPENSIVE_DECODES_PER_THREAD = 4
EXPENSIVE = object()  # what the ordinary pool answers for an image it hands on to the expensive one
# A lone request (no other image in flight, no decode thread busy) prepares its image right on the
# event loop instead: the loop has nothing else to do, and the round trip to a thread that has been
# idle cost 0.5 ms and more on the hosts measured (a sleeping core wakes slowly, and a decode that
# runs on it just after is slower still: a 448x448 JPEG 1.9 against 1.3 ms on an H200 host), about
# a tenth of a lone 448x448 image's time. Only what stalls the loop briefly: a JPEG (or a client's
# patches, whose check is their length) of at most ALONE_INLINE_BYTES, whose header says at most
# ALONE_MAX_PIXELS (a 1008x1008 or 1024x1024 photo, 6 ms on an H200 host's core) and no more scans
# than encoders write; anything else goes to the threads as before. The worst such file a caller can
# make (noise in 10-16 scans of 1.3 Mpx) holds the loop 20-30 ms on a 2-core CPU host; a call arriving then
# waits that long, once: while this image is in flight, the next goes to the threads.
ALONE_INLINE_BYTES = 512 << 10
ALONE_MAX_PIXELS = 5 << 18  # 1.25 Mi pixels
# And only a JPEG whose header is short and plain (decode.plain_jpeg_header): Pillow parses a header in
# Python, a read per fill byte and a call per segment (a 64x64 image behind 500 KiB of fill bytes held
# the loop 250 ms), and an EXIF block of thousands of entries is parsed and written back (66 KB: 105 ms).
ALONE_HEADER_BYTES = 8 << 10
ALONE_HEADER_SEGMENTS = 32

T = TypeVar("T")


class PreparePools:
    def __init__(self, preprocess_threads: int) -> None:
        self._pool = ThreadPoolExecutor(preprocess_threads, thread_name_prefix="preprocess")
        # Who gets the next ordinary thread: images are short work, so turns without a reserve.
        self._turns = FairSlots(preprocess_threads, what="image decode threads", reserve=False)
        expensive_threads = max(1, preprocess_threads // 4)
        self._expensive_pool = ThreadPoolExecutor(expensive_threads, thread_name_prefix="preprocess-expensive")
        self._expensive_capacity = EXPENSIVE_DECODES_PER_THREAD * expensive_threads
        self._expensive_waiting = 0
        self._hash_pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="hash")

    @property
    def busy(self) -> bool:
        """Whether some image holds a decode thread, ordinary or expensive (a cancelled one's included,
        until it is done)."""
        return self._turns.free < self._turns.slots or self._expensive_waiting > 0

    async def hashed(self, keys: Callable[[Sequence], list[str]], images: Sequence, *,
                     alone: bool = False) -> list[str]:
        """The images' keys, never behind other requests' decoding: that would make cache hits and
        admission (RESOURCE_EXHAUSTED) wait for it under load. Small requests are hashed right here
        (sha256 runs ~1.5 GB/s); larger ones in a pool of their own, unless the request is ``alone``
        (nothing else in flight) and of at most ALONE_INLINE_BYTES."""
        size = sum(image.nbytes for image in images)
        if size <= HASH_INLINE_BYTES or (alone and size <= ALONE_INLINE_BYTES):
            return keys(images)
        return await asyncio.get_running_loop().run_in_executor(self._hash_pool, keys, images)

    async def prepared(self, prepare: Callable[[object, int | None], T], image: object, ordinary_pixels: int,
                       caller: Caller | None = None, *, alone: bool = False) -> T:
        """``prepare(image, expensive_pixels)`` (it answers ``EXPENSIVE`` for an image of more pixels,
        or more scans, by its header; None: it prepares anything): right here if the request is
        ``alone`` and the image is small (see ALONE_INLINE_BYTES), else in the ordinary pool, in
        ``caller``'s turn; if it answers ``EXPENSIVE``, again in the expensive pool, if that has room."""
        if alone and not self.busy and image.nbytes <= ALONE_INLINE_BYTES and _cheap_to_check(image):
            payload = prepare(image, min(ordinary_pixels, ALONE_MAX_PIXELS))
            if payload is not EXPENSIVE:
                return payload
        async with self._turns.slot(caller or Caller()):
            # A cancelled caller's decode cannot be stopped mid-image: its turn ends when the thread is free.
            payload = await run_to_the_end(self._pool, prepare, image, ordinary_pixels, stop=threading.Event())
        if payload is not EXPENSIVE:
            return payload
        if self._expensive_waiting >= self._expensive_capacity:
            raise ResourceExhausted(
                f"{self._expensive_waiting} images that are expensive to decode (JPEGs of more than "
                f"{decode.ORDINARY_JPEG_SCANS} scans, or of more than {ordinary_pixels} pixels) are "
                "already being decoded or waiting; retry later", retry_after_s=RETRY_AFTER_S)
        self._expensive_waiting += 1
        try:
            # Counted until its thread is done, a cancelled caller's too: the bound is on threads' work.
            return await run_to_the_end(self._expensive_pool, prepare, image, None, stop=threading.Event())
        finally:
            self._expensive_waiting -= 1

    def shutdown(self) -> None:
        for pool in (self._pool, self._expensive_pool, self._hash_pool):
            pool.shutdown(wait=False, cancel_futures=True)


def _cheap_to_check(image: object) -> bool:
    """Whether an image may be prepared on the loop when alone: a JPEG whose header is short and plain
    (that header then bounds the decode: pixels and scans) or a client's patches (a length check); other
    formats' decoders are slower a pixel and bounded less tightly by their headers."""
    kind = getattr(image, "kind", None)
    return kind == "patches" or (
        kind == "encoded" and decode.plain_jpeg_header(image.data, ALONE_HEADER_BYTES, ALONE_HEADER_SEGMENTS))
