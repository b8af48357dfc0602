"""EmbeddingSink servers for the sink-fault scenario: the real receiver and hand-written faulty ones.

Each runs a grpc.aio server on its own event loop thread and can be stopped and started again on
the same port (a flapping sink)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import grpc
from encoder_client import EmbeddingSinkReceiver
from encoder_client.protocol import encoder_pb2, encoder_pb2_grpc


class WrongAck(encoder_pb2_grpc.EmbeddingSinkServicer):
    """Reads the whole push and acknowledges one image more than it was sent."""

    async def Push(self, request_iterator, context):
        num_images = 0
        async for chunk in request_iterator:
            num_images = chunk.num_images
        return encoder_pb2.PushAck(images=num_images + 1)


class NeverAck(encoder_pb2_grpc.EmbeddingSinkServicer):
    """Reads the whole push and then never answers (until the caller gives up)."""

    async def Push(self, request_iterator, context):
        async for _ in request_iterator:
            pass
        await asyncio.sleep(3600)


class SlowReader(encoder_pb2_grpc.EmbeddingSinkServicer):
    """Takes each chunk after a pause: backpressure all the way to the encoder."""

    def __init__(self, pause_s: float = 0.3) -> None:
        self.pause_s = pause_s

    async def Push(self, request_iterator, context):
        n = 0
        async for chunk in request_iterator:
            n = chunk.num_images
            await asyncio.sleep(self.pause_s)
        return encoder_pb2.PushAck(images=n)


class SinkServer:
    """A sink on 127.0.0.1 (a free port unless given) on its own event loop thread; ``servicer`` is
    made anew at each start; ``credentials`` (grpc.ServerCredentials) make the port TLS-only."""

    def __init__(self, servicer: Callable[[], encoder_pb2_grpc.EmbeddingSinkServicer], port: int = 0,
                 credentials: grpc.ServerCredentials | None = None) -> None:
        self._make = servicer
        self._credentials = credentials
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.port = port
        self.servicer = None
        self._server: grpc.aio.Server | None = None
        self.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def receiver(self) -> EmbeddingSinkReceiver:
        """The servicer, when it is a real receiver."""
        return self.servicer

    def call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self):
        self.servicer = self._make()
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        encoder_pb2_grpc.add_EmbeddingSinkServicer_to_server(self.servicer, server)
        address = f"127.0.0.1:{self.port}"
        self.port = (server.add_secure_port(address, self._credentials) if self._credentials is not None
                     else server.add_insecure_port(address))
        await server.start()
        self._server = server

    def start(self) -> None:
        self.call(self._start())

    def stop(self) -> None:
        """Stops serving (the port is closed: pushes fail to connect) but keeps the loop for a restart."""
        if self._server is not None:
            self.call(self._server.stop(0))
            self._server = None
        if isinstance(self.servicer, EmbeddingSinkReceiver):
            self.call(self.servicer.close())

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    def wait(self, request_id: str, timeout_s: float = 10.0):
        """The images a real receiver got for request_id."""
        return self.call(self.servicer.wait(request_id, timeout_s=timeout_s), timeout_s + 5)


def receiver(**kwargs) -> Callable[[], EmbeddingSinkReceiver]:
    return lambda: EmbeddingSinkReceiver(**kwargs)
