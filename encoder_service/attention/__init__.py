"""Attention backends: one interface (``AttentionBackend``), a registry and a selector."""

from .base import AttentionBackend
from .selector import AUTO, select_backend, valid_names

__all__ = ["AUTO", "AttentionBackend", "select_backend", "valid_names"]
