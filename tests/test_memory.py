"""Idle RSS returns near its start after a burst: freed memory goes back to the kernel."""

from __future__ import annotations

import re

import numpy as np

from encoder_service import memory


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def test_release_free_memory_hands_freed_heap_back_to_the_kernel():
    assert memory.release_free_memory()  # glibc on Linux: CI's and the images'
    before = rss_mib()
    # Many medium blocks (below the mmap threshold, so they come from the heap), every other one
    # kept alive: what is freed stays fragmented in the arena until trimmed.
    blocks = [np.ones(100_000, dtype=np.uint8) for _ in range(4000)]
    del blocks[::2]
    del blocks[: len(blocks) // 2]
    held = rss_mib()
    assert memory.release_free_memory()
    after = rss_mib()
    print(f"RSS {before:.0f} MiB at start, {held:.0f} MiB holding, {after:.0f} MiB after trim")
    assert after < held - 100
