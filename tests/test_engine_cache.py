"""EmbeddingCache: LRU by bytes, pins, oversize entries."""

from __future__ import annotations

import torch

from encoder_service.engine import EmbeddingCache

GRID = (1, 2, 2)


def emb(rows: int) -> torch.Tensor:
    return torch.zeros(rows, 8)  # 32 bytes per row


def test_lru_evicts_least_recently_used_by_bytes():
    evicted = []
    cache = EmbeddingCache(3 * 320, on_evict=lambda e: evicted.append(e.key))
    for key in "abc":
        assert cache.put(key, emb(10), GRID)
    cache.release(cache.acquire("a").key)  # "a" is now the most recently used
    assert cache.put("d", emb(10), GRID)
    assert evicted == ["b"]
    assert [k in cache for k in "abcd"] == [True, False, True, True]
    assert cache.used_bytes == 3 * 320


def test_a_big_entry_evicts_several_small_ones():
    cache = EmbeddingCache(1000)
    for key in "abc":
        cache.put(key, emb(10), GRID)  # 320 bytes each
    assert cache.put("big", emb(20), GRID)  # 640: needs two evictions
    assert ["a" in cache, "b" in cache, "c" in cache, "big" in cache] == [False, False, True, True]
    assert cache.used_bytes == 960


def test_pinned_entries_are_not_evicted():
    cache = EmbeddingCache(640)
    cache.put("a", emb(10), GRID)
    cache.put("b", emb(10), GRID)
    cache.acquire("a")
    cache.acquire("b")
    assert not cache.put("c", emb(10), GRID)  # no room without evicting a pinned entry
    assert "a" in cache and "b" in cache and "c" not in cache
    cache.release("a")
    assert cache.put("c", emb(10), GRID)
    assert "a" not in cache and "b" in cache and "c" in cache


def test_put_with_pins_protects_a_fresh_entry_until_released():
    cache = EmbeddingCache(320)
    cache.put("a", emb(10), GRID, pins=2)
    assert not cache.put("b", emb(10), GRID)
    cache.release("a")
    assert not cache.put("b", emb(10), GRID)
    cache.release("a")
    assert cache.put("b", emb(10), GRID) and "a" not in cache


def test_entry_larger_than_the_cache_is_not_stored_and_evicts_nothing():
    cache = EmbeddingCache(640)
    cache.put("a", emb(10), GRID)
    assert not cache.put("huge", emb(30), GRID)
    assert "a" in cache and "huge" not in cache


def test_peek_does_not_change_recency():
    cache = EmbeddingCache(640)
    cache.put("a", emb(10), GRID)
    cache.put("b", emb(10), GRID)
    assert cache.peek("a") is not None
    cache.put("c", emb(10), GRID)
    assert "a" not in cache and "b" in cache
