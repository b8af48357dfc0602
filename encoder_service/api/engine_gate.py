"""The engine as every front end reaches it: the VisionEncoder servicer (api/servicer.py) and the
SGLang port (api/sglang/front_end.py) share one ``EngineGate``, so neither calls the other.

The gate is closed (UNAVAILABLE) until the model is loaded and warmed (``open``), and again once the
server drains (``CallBook.draining``)."""

from __future__ import annotations

import contextlib

from ..engine import Engine, ImageInput, ImageResult
from ..errors import Unavailable
from .service_interceptor import CallBook


class EngineGate:
    def __init__(self, calls: CallBook) -> None:
        self.calls = calls  # whether the server drains
        self.engine: Engine | None = None  # set by ``open``, once the model is loaded and warmed

    def open(self, engine: Engine) -> None:
        """The model is loaded and warmed: calls reach ``engine`` from now on."""
        self.engine = engine

    def ready(self) -> Engine:
        """The engine, or Unavailable while the server starts or drains."""
        if self.calls.draining:
            raise Unavailable("server is draining (shutting down); retry on another replica")
        if self.engine is None:
            raise Unavailable("server is starting: the model is not loaded and warmed up yet")
        return self.engine

    async def encode_all(self, images: list[ImageInput]) -> list[tuple[ImageResult, bytes]]:
        """Encode's engine path (cache, in-flight joins, admission, batching) without a transport:
        every image's result and its rows as raw bytes in the model dtype, in request order. Each
        result's cache pin is released once its bytes are copied."""
        engine = self.ready()
        dtype = engine.describe().dtype
        out: list = [None] * len(images)
        async with contextlib.aclosing(engine.encode(images)) as results:
            async for result in results:
                out[result.index] = (result, bytes(result.wire_bytes(dtype)))
        return out
