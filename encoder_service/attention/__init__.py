"""Attention backends: one interface (``AttentionBackend``), a registry and a selector."""

from .base import AttentionBackend, RaggedOnly
from .selector import AUTO, graph_backend, select_backend, valid_names

__all__ = ["AUTO", "AttentionBackend", "RaggedOnly", "graph_backend", "select_backend", "valid_names"]
