"""Whole forwards replayed as CUDA graphs, one per batch composition (the tuple of grids).

A forward of Qwen2.5-VL-7B is ~230 kernels; launched one by one, the device idles a few
microseconds between them even when the host is far ahead (bench/RESULTS.md). A graph replays them
back to back. Everything a forward reads besides the pixels (metadata, attention plans) depends
only on the grids, so a graph captured for one batch serves every later batch of the same grids:
the new pixels are copied into the graph's input buffer and the graph is replayed.

Policy, as vLLM and SGLang treat their decode graphs: capture costs about one forward and holds the
forward's activations in a private memory pool, so a composition is captured only the second time
it is seen (the first, eager, call also compiles the kernels the capture needs), and only the
``capacity`` most recently used graphs are kept. A composition whose capture fails runs eagerly
from then on, and the failure is logged once.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor  # the input buffer the graph reads
    out: torch.Tensor  # the output buffer it writes
    staged: Any  # the metadata and plans it reads, kept alive with it


class GraphCache:
    def __init__(self, capacity: int = 4, seen_capacity: int = 256) -> None:
        self.capacity = capacity
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._seen: OrderedDict[Hashable, bool] = OrderedDict()  # key -> capturable
        self._seen_capacity = seen_capacity
        self.replays = 0
        self.captures = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, pixels: torch.Tensor, stage: Callable[[], Any],
            forward: Callable[[torch.Tensor, Any], torch.Tensor]) -> torch.Tensor:
        """``forward(pixels, stage())``, replayed from a graph where one is kept for ``key``."""
        entry = self._graphs.get(key)
        if entry is None and self.capacity > 0 and self._seen.get(key):
            entry = self._capture(key, pixels, stage, forward)
        if entry is None:
            out = forward(pixels, stage())
            if key not in self._seen:
                self._seen[key] = True
                if len(self._seen) > self._seen_capacity:
                    self._seen.popitem(last=False)
            return out
        self._graphs.move_to_end(key)
        entry.pixels.copy_(pixels)
        entry.graph.replay()
        self.replays += 1
        # A fresh tensor: the buffer is overwritten by the next replay, and callers may keep this one.
        return entry.out.clone()

    def _capture(self, key, pixels, stage, forward) -> _Graph | None:
        staged = stage()
        static_pixels = pixels.clone()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: other threads of the server (request handlers pinning host memory)
            # may keep making CUDA calls while this one captures.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = forward(static_pixels, staged)
        except Exception as exc:  # a kernel that cannot be captured: this composition stays eager
            log.warning("CUDA graph capture failed for a batch of %s; it runs eagerly: %s: %s",
                        key, type(exc).__name__, exc)
            self._seen[key] = False
            return None
        self.captures += 1
        entry = _Graph(graph, static_pixels, out, staged)
        self._graphs[key] = entry
        while len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)
        return entry
