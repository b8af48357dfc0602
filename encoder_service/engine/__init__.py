"""Admission, the embedding cache, batching across requests and the device worker.

Knows tensors and requests; knows nothing of protobuf.
"""

from .cache import EmbeddingCache
from .engine import Engine
from .types import ImageInput, ImageResult, ModelDescription, Timing

__all__ = ["EmbeddingCache", "Engine", "ImageInput", "ImageResult", "ModelDescription", "Timing"]
