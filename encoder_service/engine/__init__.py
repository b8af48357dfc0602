"""Admission, the embedding cache, batching across requests and the device worker.

Knows tensors and requests; knows nothing of protobuf.
"""

from .cache import EmbeddingCache
from .engine import Engine
from .types import EngineStats, ImageInput, ImageResult, ModelDescription, Timing

__all__ = ["EmbeddingCache", "Engine", "EngineStats", "ImageInput", "ImageResult", "ModelDescription", "Timing"]
