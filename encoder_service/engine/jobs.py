"""The engine's bookkeeping of one uncached image (a job, shared by every request asking for it)
and of one request's image slot waiting for it. Lives on the event loop."""

from __future__ import annotations

import asyncio
import enum
import functools
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import EncoderError, ResourceExhausted
from ..preprocess.staged import StagedInput
from .batch_queue import BatchQueue, WorkItem
from .cache import CacheEntry, EmbeddingCache
from .types import ClipFrames, Grid, ImageInput, ImageResult, Timing


class JobState(enum.Enum):
    """Where a job is: PREPARING -> PREPARED -> QUEUED -> RUNNING -> DONE | FAILED | ABANDONED."""

    PREPARING = "preparing"
    PREPARED = "prepared"
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    ABANDONED = "abandoned"


class ClipParts:
    """A job's forward work once it is queued: its items (one, or a clip's parts in order, as
    ``clip_parts.work_items`` cut it), how many of them entered a forward, and a split clip's embeddings
    as they come back. Whether the job is split is fixed when it is cut, not read from the items still
    held: those are let go (they hold the payload) while a split clip's parts may still come back."""

    def __init__(self, items: Sequence[WorkItem] = ()) -> None:
        self._items = tuple(items)
        self._count = len(self._items)
        self._started = 0
        self._embeddings: list[tuple[int, torch.Tensor]] = []

    @property
    def items(self) -> tuple[WorkItem, ...]:
        """The items still held (none once released)."""
        return self._items

    @property
    def split(self) -> bool:
        """Whether the job was cut into several forwards (a clip over --max-batch-tokens)."""
        return self._count > 1

    def start(self) -> bool:
        """One item entered a forward; True once every item has (the job waits for no forward to start)."""
        self._started += 1
        return self._started >= self._count

    def gather(self, item: WorkItem, embedding: torch.Tensor) -> torch.Tensor | None:
        """One item's embedding: the job's whole embedding once every part has come back (the parts'
        rows in order), else None."""
        if not self.split:
            return embedding
        self._embeddings.append((item.part, embedding))
        if len(self._embeddings) < self._count:
            return None
        whole = torch.cat([e for _, e in sorted(self._embeddings, key=lambda p: p[0])])
        self._embeddings = []
        return whole

    def withdraw(self, queue: BatchQueue) -> None:
        """A split clip nobody waits for, or one of whose parts failed: its parts not yet taken leave the
        queue; those a worker took run and are ignored (the job is no longer running)."""
        for item in self._items:
            queue.remove(item)
        self._embeddings = []

    def release(self) -> None:
        """Lets go of the items and of any embeddings gathered: the payload is freed as soon as no forward
        holds it either."""
        self._items, self._embeddings = (), []


@dataclass(eq=False)
class Job:
    """One uncached image being computed; shared by every request that asked for the same key."""

    key: str
    refs: int = 1  # requests (image slots) still waiting for it
    state: JobState = JobState.PREPARING
    payload: StagedInput | None = None  # what the device worker turns into patches
    grid: Grid | None = None
    parts: ClipParts = field(default_factory=ClipParts)  # its forward work, once queued
    holds_slot: bool = True  # an admission slot, until it (a split clip: its last part) enters a forward or is dropped
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
