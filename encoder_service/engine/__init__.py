"""Admission, the embedding cache, batching across requests, the device workers (a thread, or one
process per device), model loading, metrics recording and the liveness watchdog.

Knows tensors and requests; knows nothing of gRPC or protobuf (tests/test_architecture.py checks).
Talks to a model only through ``models.served.ServedModel``.
"""

from .cache import EmbeddingCache
from .engine import Engine
from .types import ImageInput, ImageResult, Timing

__all__ = ["EmbeddingCache", "Engine", "ImageInput", "ImageResult", "Timing"]
