"""The engine's bookkeeping of one uncached image (a job, shared by every request asking for it)
and of one request's image slot waiting for it. Lives on the event loop."""

from __future__ import annotations

import asyncio
import functools
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ..errors import EncoderError, ResourceExhausted
from ..preprocess.staged import StagedInput
from .batch_queue import WorkItem
from .cache import CacheEntry, EmbeddingCache
from .types import ClipFrames, Grid, ImageInput, ImageResult, Timing


@dataclass(eq=False)
class Job:
    """One uncached image being computed; shared by every request that asked for the same key."""

    key: str
    refs: int = 1  # requests (image slots) still waiting for it
    state: str = "preparing"  # preparing -> prepared -> queued -> running -> done | failed | abandoned
    payload: StagedInput | None = None  # what the device worker turns into patches
    grid: Grid | None = None
    items: list[WorkItem] = field(default_factory=list)  # queued: one, or a clip's parts in order
    parts: list = field(default_factory=list)  # a split clip: each part's embedding, once computed
    holds_slot: bool = True  # an admission slot, until it (a split clip: its last part) enters a forward or is dropped
    parts_started: int = 0  # items that entered a forward
    stored: bool = False  # whether the cache took it (then each remaining ref holds a pin)
    timing: Timing = field(default_factory=Timing)
    clip: ClipFrames | None = None  # a clip's sampled frames, once prepared
    task: asyncio.Task | None = None  # what prepares it: cancelled when nobody waits any more
    prepared: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def __post_init__(self) -> None:
        for fut in (self.prepared, self.done):  # an error nobody waits for is not worth a warning
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())


@dataclass(eq=False)
class Wait:
    """One image slot of one request waiting for a job; leaves it exactly once."""

    image: ImageInput
    job: Job
    left: bool = False

    def leave(self, release: Callable[[Job], None]) -> None:
        if not self.left:
            self.left = True
            release(self.job)


async def await_prepared(waits: list[Wait]) -> None:
    """Until every image of a request is prepared; the first failure (in image order) raised, tagged
    with this request's image index."""
    futures = {w.job.prepared for w in waits}
    if futures:
        # asyncio.wait, not gather: a cancelled request must not cancel futures others share.
        await asyncio.wait(futures)
    for wait in sorted(waits, key=lambda w: w.image.index):
        exc = wait.job.prepared.exception()
        if exc is not None:
            raise retag(exc, wait.image.index) from None


async def completed(waits: list[Wait]) -> AsyncIterator[tuple[Wait, object]]:
    """(wait, embedding) as each job's forward completes (in image order among those done at once);
    a failure raised, tagged with this request's image index."""
    by_future: dict[asyncio.Future, list[Wait]] = {}
    for wait in waits:
        by_future.setdefault(wait.job.done, []).append(wait)
    pending = set(by_future)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for fut in sorted(done, key=lambda f: by_future[f][0].image.index):
            for wait in by_future[fut]:
                exc = fut.exception()
                if exc is not None:
                    raise retag(exc, wait.image.index)
                yield wait, fut.result()


def retag(exc: BaseException, index: int) -> BaseException:
    """A copy of a typed error naming this request's image index (jobs are shared across requests):
    the same type, retry hint and all (``EncoderError.for_image``)."""
    if isinstance(exc, EncoderError):
        return exc.for_image(index)
    return exc


def detached(exc: BaseException) -> BaseException:
    """The error to keep on a job's future (shared, and kept as long as any request waits for it):
    one that holds no frames. A preparation's traceback holds the frames it failed in, and their
    locals the decoded pixels (tens of MB an image); dropped here, they are freed at once, not at the
    next pass of the cycle collector. A MemoryError (an image whose decode the host could not
    allocate) is the caller's RESOURCE_EXHAUSTED, not INTERNAL. Any other error (a bug) keeps where it
    was raised as a note, for the log."""
    if isinstance(exc, EncoderError):
        exc.__traceback__ = exc.__context__ = exc.__cause__ = None
        return exc
    if isinstance(exc, MemoryError):
        return ResourceExhausted("preparing the image needed more memory than the server could allocate; "
                                 "a smaller image needs less")
    if exc.__traceback__ is not None:
        exc.add_note("raised at (traceback dropped):\n" + "".join(traceback.format_tb(exc.__traceback__)).rstrip())
    return exc.with_traceback(None)


def image_result(index: int, entry: CacheEntry | None, embedding, cache: EmbeddingCache, feature_levels: int, *,
                 cache_hit: bool, job: Job | None = None) -> ImageResult:
    """One image's result; with its cache entry (if it is the one cached), the conversions to other
    dtypes that entry keeps, and the way to keep a new one."""
    if entry is not None and entry.embedding is not embedding:
        entry = None  # evicted and computed again meanwhile: not this result's entry
    key, grid, clip = (job.key, job.grid, job.clip) if job is not None else (entry.key, entry.grid, entry.clip)
    return ImageResult(
        index, key, grid, embedding, cache_hit=cache_hit, timing=job.timing if job is not None else Timing(),
        feature_levels=feature_levels, conversions=entry.conversions if entry is not None else None,
        keep_conversion=functools.partial(cache.add_conversion, entry) if entry is not None else None,
        clip=clip)
