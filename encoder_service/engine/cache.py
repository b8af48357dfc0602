"""Per-image embedding cache: LRU by bytes, with pins for entries that are being streamed.

Used from the event loop only (no locks). Keys are server-computed content hashes. Values are CPU
tensors; their size is the tensor's ``nbytes``. An entry with pins > 0 is never evicted (a stream
still reads it, so evicting it would free nothing and would let the cache over-count its room).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .types import Grid


@dataclass
class CacheEntry:
    key: str
    embedding: torch.Tensor
    grid: Grid
    nbytes: int
    pins: int = 0


class EmbeddingCache:
    def __init__(self, capacity_bytes: int, on_evict: Callable[[CacheEntry], None] | None = None) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()  # oldest first
        self._used_bytes = 0
        self._on_evict = on_evict

    # --- queries ---------------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def peek(self, key: str) -> CacheEntry | None:
        """The entry without touching its recency (Lookup is a hint, not a use)."""
        return self._entries.get(key)

    # --- use ---------------------------------------------------------------------------------------
    def acquire(self, key: str) -> CacheEntry | None:
        """The entry, marked most recently used and pinned; the caller must ``release(key)`` it."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        entry.pins += 1
        return entry

    def release(self, key: str) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def put(self, key: str, embedding: torch.Tensor, grid: Grid, pins: int = 0) -> bool:
        """Stores a CPU tensor with ``pins`` pins already held; False if it was not stored.

        Not stored: larger than the whole cache, or the room cannot be freed because the other
        entries are pinned. The caller serves the tensor it holds either way.
        """
        nbytes = int(embedding.nbytes)
        existing = self._entries.get(key)
        if existing is not None:  # same content computed twice (e.g. after an eviction race)
            existing.pins += pins
            self._entries.move_to_end(key)
            return True
        if nbytes > self.capacity_bytes:
            return False
        if not self._shrink_to(self.capacity_bytes - nbytes):
            return False
        self._entries[key] = CacheEntry(key, embedding, grid, nbytes, pins)
        self._used_bytes += nbytes
        return True

    # --- eviction ----------------------------------------------------------------------------------
    def _shrink_to(self, target_bytes: int) -> bool:
        """Evicts unpinned entries, least recently used first, until used <= target."""
        if self._used_bytes <= target_bytes:
            return True
        pinned_bytes = sum(e.nbytes for e in self._entries.values() if e.pins > 0)
        if pinned_bytes > target_bytes:
            return False  # evicting would not make enough room: keep what is there
        for key in [k for k, e in self._entries.items() if e.pins == 0]:
            entry = self._entries.pop(key)
            self._used_bytes -= entry.nbytes
            if self._on_evict is not None:
                self._on_evict(entry)
            if self._used_bytes <= target_bytes:
                return True
        return self._used_bytes <= target_bytes
