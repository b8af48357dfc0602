"""The queue between the event loop (producer) and the device worker thread (consumer).

Thread-safe. The worker takes FIFO batches bounded by a patch budget; the loop may remove an item
that no request waits for any more, as long as the worker has not taken it yet.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..preprocess.staged import StagedInput
from .types import Grid


@dataclass(eq=False)
class WorkItem:
    payload: StagedInput  # uint8 pixels of a decoded image, or a client's patch bytes
    grid: Grid
    job: Any  # the engine's bookkeeping object; opaque here
    enqueued_at: float = field(default_factory=time.perf_counter)
    part: int = 0  # a clip split over forwards: which part of its job this is (engine/engine.py)

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid
        return t * h * w


class BatchQueue:
    def __init__(self) -> None:
        self._items: deque[WorkItem] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def oldest_enqueued_at(self) -> float | None:
        """perf_counter time at which the item waiting longest was queued; None if none waits."""
        with self._cond:
            return self._items[0].enqueued_at if self._items else None

    def put(self, item: WorkItem) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("queue closed")
            self._items.append(item)
            self._cond.notify()

    def remove(self, item: WorkItem) -> bool:
        """True if the item was still waiting (now removed); False if a batch already took it."""
        with self._cond:
            try:
                self._items.remove(item)
            except ValueError:
                return False
            return True

    def close(self) -> list[WorkItem]:
        """Stops the worker after its current batch; returns the items it will never take."""
        with self._cond:
            self._closed = True
            left = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return left

    def take_batch(self, max_patches: int, wait_s: float = 0.0, block: bool = True,
                   idle_timeout_s: float | None = None) -> list[WorkItem] | None:
        """Blocks until there is work; returns FIFO items up to ``max_patches`` (at least one).

        With ``wait_s`` > 0, waits up to that long for a batch that is not yet full to fill up:
        a short wait trades a little latency for fewer, larger forwards. None once closed.
        ``block=False``: returns whatever is queued now without waiting, an empty list if nothing.
        ``idle_timeout_s``: blocks at most this long for a first item, then returns an empty list
        (a consumer that must look at something else now and then, e.g. whether its process lives).
        """
        with self._cond:
            if not block:
                if self._closed:
                    return None
                return self._pop(max_patches)
            while True:
                idle_deadline = None if idle_timeout_s is None else time.monotonic() + idle_timeout_s
                while not self._items and not self._closed:
                    if idle_deadline is None:
                        self._cond.wait()
                        continue
                    remaining = idle_deadline - time.monotonic()
                    if remaining <= 0:
                        return []
                    self._cond.wait(remaining)
                if self._closed:
                    return None
                if wait_s > 0:
                    deadline = time.monotonic() + wait_s
                    while not self._closed and self._queued_patches() < max_patches:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        self._cond.wait(remaining)
                    if self._closed:
                        return None
                if self._items:  # items may have been removed (cancelled) during the wait
                    break
            return self._pop(max_patches)

    def _pop(self, max_patches: int) -> list[WorkItem]:
        batch: list[WorkItem] = []
        total = 0
        while self._items:
            n = self._items[0].num_patches
            if batch and total + n > max_patches:
                break
            batch.append(self._items.popleft())
            total += n
        return batch

    def _queued_patches(self) -> int:
        return sum(item.num_patches for item in self._items)
