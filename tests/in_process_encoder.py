"""The real gRPC server (servicer, engine, interceptor) around an in-memory model, on a loop thread of the
test's own process: for tests that watch or replace a part of the server (a model that blocks, an executor
that notes its work), which a server process would not let them."""

from __future__ import annotations

import asyncio
import threading

import grpc

from encoder_service.api.caller_regions import CallerRegions
from encoder_service.api.server import _add_vision_encoder, _grpc_options
from encoder_service.api.service_interceptor import CallBook, ServiceInterceptor
from encoder_service.api.servicer import VisionEncoderServicer
from encoder_service.config import ServiceConfig
from encoder_service.engine import Engine
from encoder_service.metrics import ServiceMetrics


class InProcessEncoder:
    """The real gRPC server (servicer and engine) around an in-memory model, on its own loop thread."""

    def __init__(self, model, **config) -> None:
        self.config = ServiceConfig(host="127.0.0.1", port=0, batch_wait_ms=0.0, **config)
        self.model = model
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._start())

    def _call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self) -> None:
        self.metrics, calls = ServiceMetrics(), CallBook()
        shared_memory = self.config.shared_memory == "on"
        # As the server does: callers on this host may register regions by descriptor.
        self.caller_regions = CallerRegions() if shared_memory else None
        if self.caller_regions is not None:
            self.caller_regions.start()
        self.servicer = VisionEncoderServicer(self.config.requests, self.config.security, self.metrics, calls,
                                              shared_memory=shared_memory, caller_regions=self.caller_regions)
        self.engine = Engine(self.config, self.model, metrics=self.metrics)
        try:
            await self.engine.start()
        except BaseException:
            if self.caller_regions is not None:
                self.caller_regions.close()
            raise
        self.servicer.engine = self.engine
        self.server = grpc.aio.server(options=_grpc_options(self.config),
                                      interceptors=[ServiceInterceptor(self.metrics, calls)])
        _add_vision_encoder(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    async def _stop(self) -> None:
        await self.server.stop(0)
        await self.engine.stop()
        await self.servicer.close()
        if self.caller_regions is not None:
            self.caller_regions.close()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
