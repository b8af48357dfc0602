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


def test_a_conversion_is_kept_with_its_entry_and_counted_in_the_cache_bytes():
    cache = EmbeddingCache(1000)
    cache.put("a", emb(10), GRID)
    entry = cache.acquire("a")
    assert cache.add_conversion(entry, "float16", b"x" * 160)
    assert cache.used_bytes == 480 and entry.nbytes == 480
    assert bytes(entry.conversions["float16"]) == b"x" * 160
    cache.release("a")


def test_a_conversion_evicts_older_entries_but_never_its_own():
    evicted = []
    cache = EmbeddingCache(3 * 320, on_evict=lambda e: evicted.append(e.key))
    for key in "abc":
        cache.put(key, emb(10), GRID)
    entry = cache.peek("a")  # the oldest entry: a conversion of it must not evict it
    assert cache.add_conversion(entry, "float16", b"x" * 160)
    assert evicted == ["b"] and "a" in cache and cache.used_bytes == 320 + 160 + 320


def test_a_conversion_with_no_room_is_not_kept_and_evicts_nothing():
    cache = EmbeddingCache(640)
    cache.put("a", emb(10), GRID, pins=1)
    cache.put("b", emb(10), GRID, pins=1)
    assert not cache.add_conversion(cache.peek("a"), "float16", b"x" * 160)
    assert "float16" not in cache.peek("a").conversions and cache.used_bytes == 640


def test_a_conversion_of_an_entry_no_longer_cached_is_not_kept():
    cache = EmbeddingCache(640)
    cache.put("a", emb(10), GRID)
    stale = cache.peek("a")
    cache.put("b", emb(10), GRID)
    cache.put("c", emb(10), GRID)  # evicts "a"
    cache.put("a", emb(10), GRID)  # the same key again: another entry
    assert not cache.add_conversion(stale, "float16", b"x" * 160)
    assert cache.peek("a").conversions == {} and cache.used_bytes == 640


def test_evicting_an_entry_frees_its_conversions_too():
    cache = EmbeddingCache(800)
    cache.put("a", emb(10), GRID)
    cache.add_conversion(cache.peek("a"), "float16", b"x" * 160)
    assert cache.put("b", emb(10), GRID) and cache.used_bytes == 800
    assert cache.put("c", emb(10), GRID)  # needs a's 480 bytes
    assert "a" not in cache and cache.used_bytes == 640
