"""Per-image embedding cache: LRU by bytes, with pins for entries that are being streamed.

Used from the event loop only (no locks). Keys are server-computed content hashes. Values are CPU
tensors in the model dtype, which is also their wire layout (responses are views of them). An entry
also keeps its rows in each other wire dtype a client has asked for (``add_conversion``), so that a
hit in that dtype is not converted again; an entry's size is all of these bytes. An entry with
pins > 0 is never evicted (a stream still reads it, so evicting it would free nothing and would let
the cache over-count its room).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .types import Grid


@dataclass
class CacheEntry:
    key: str
    embedding: torch.Tensor
    grid: Grid
    nbytes: int  # the embedding's and its conversions' bytes
    pins: int = 0
    conversions: dict[str, bytes] = field(default_factory=dict)  # wire dtype name -> raw rows
    clip: object | None = None  # a clip's ClipFrames (engine.types), served again with each hit


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

    def put(self, key: str, embedding: torch.Tensor, grid: Grid, pins: int = 0, clip: object | None = None) -> bool:
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
        self._entries[key] = CacheEntry(key, embedding, grid, nbytes, pins, clip=clip)
        self._used_bytes += nbytes
        return True

    def add_conversion(self, entry: CacheEntry, dtype_name: str, data: bytes) -> bool:
        """Keeps ``data`` (the entry's rows as wire bytes in ``dtype_name``) with the entry; False if
        not kept: the entry is no longer cached, or the room cannot be freed without evicting
        pinned entries. Makes room like ``put``, least recently used first, never the entry itself."""
        if self._entries.get(entry.key) is not entry:
            return False
        if dtype_name in entry.conversions:
            return True
        entry.pins += 1  # the entry is being served: making room must not evict it
        try:
            room = self._shrink_to(self.capacity_bytes - len(data))
        finally:
            entry.pins -= 1
        if not room:
            return False
        entry.conversions[dtype_name] = data
        entry.nbytes += len(data)
        self._used_bytes += len(data)
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
