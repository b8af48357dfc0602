"""The server process's side of ``--grpc-processes``: starts the relay processes (api/relay/process.py),
starts again one that dies, and stops them after the drain.

The server process then serves gRPC only on a unix socket in a directory of its own (mode 0700),
which the relays reach; the public port belongs to the relays. The first relay binds ``--port``
(0: a free one) and the others the port it got, all with SO_REUSEPORT, so the kernel spreads the
callers' connections over them. Only processes of the same user can share the port that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time

from ...config import RelayConfig, RequestLimits, SecurityConfig
from .process import RelaySpec, relay_main
from .regions import RegionBoard

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
STOP_MARGIN_S = 5.0  # past the grace, a relay that has not exited is killed


class RelayStartError(RuntimeError):
    pass


class _Running:
    def __init__(self, index: int, process, conn) -> None:
        self.index, self.process, self.conn = index, process, conn


class RelayProcesses:
    """``relays.processes`` relay processes in front of this process's unix-socket server. ``requests``
    and ``security``: the main port's message sizes and TLS, which the relays serve the port with."""

    def __init__(self, relays: RelayConfig, requests: RequestLimits, security: SecurityConfig) -> None:
        self.relays = relays
        self.requests = requests
        self.security = security
        self.count = relays.processes
        self._dir = tempfile.mkdtemp(prefix="encoder-service-")  # 0700: only this user reaches the socket
        self.upstream = f"unix:{os.path.join(self._dir, 'server.sock')}"
        # The relays hand their shared-memory regions over by descriptor, on this socket.
        self.regions = RegionBoard(os.path.join(self._dir, "regions.sock"))
        self.port = 0
        self._running: dict[int, _Running] = {}
        self._watchers: set[asyncio.Task] = set()
        self._stopping = False

    async def start(self) -> int:
        """Starts every relay; returns the public port. Raises RelayStartError (the message says why)
        when one cannot serve (the port is taken, a certificate is wrong)."""
        self.regions.start()
        try:
            self.port = await self._start_one(0, self.relays.port)
            await asyncio.gather(*(self._start_one(i, self.port) for i in range(1, self.count)))
        except BaseException:
            await self.stop(0.0)
            raise
        return self.port

    async def _start_one(self, index: int, port: int) -> int:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        spec = RelaySpec(self.relays, self.requests, self.security, self.upstream, self.regions.path, port, index)
        process = ctx.Process(target=relay_main, args=(spec, child), name=f"encoder-relay-{index}", daemon=True)
        process.start()
        child.close()  # else the relay's death would not close the pipe on our side
        running = _Running(index, process, parent)
        self._running[index] = running
        loop = asyncio.get_running_loop()
        try:
            message = await asyncio.wait_for(loop.run_in_executor(None, _receive, parent), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            process.kill()
            raise RelayStartError(f"relay {index} did not start within {START_TIMEOUT_S:.0f} s") from None
        if message[0] != "listening":
            process.join(5.0)
            raise RelayStartError(message[1])
        log.info("relay %d (pid %d) serving %s:%d", index, process.pid, self.relays.host, message[1])
        watcher = asyncio.ensure_future(self._watch(running))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return message[1]

    async def _watch(self, running: _Running) -> None:
        """Starts the relay again when it dies, unless we are stopping."""
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(running.process.sentinel, lambda: exited.done() or exited.set_result(None))
        try:
            await exited
        finally:
            loop.remove_reader(running.process.sentinel)
        running.process.join(1.0)
        if self._stopping:
            return
        log.error("relay %d (pid %d) exited with code %s; starting it again", running.index, running.process.pid,
                  running.process.exitcode)
        running.conn.close()
        for attempt in itertools.count():
            if self._stopping:
                return
            try:
                await self._start_one(running.index, self.port)
                return
            except RelayStartError as exc:
                delay = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
                log.error("relay %d did not start again (%s); next try in %.1f s", running.index, exc, delay)
                await asyncio.sleep(delay)

    async def stop(self, grace_s: float) -> None:
        """Each relay stops its server with ``grace_s`` (calls in flight finish, new ones are
        refused); one still there STOP_MARGIN_S after is killed."""
        self._stopping = True
        for watcher in list(self._watchers):
            watcher.cancel()
        running = list(self._running.values())
        for r in running:
            with contextlib.suppress(OSError):
                r.conn.send(("stop", grace_s))
        deadline = time.monotonic() + grace_s + STOP_MARGIN_S
        loop = asyncio.get_running_loop()
        for r in running:
            await loop.run_in_executor(None, r.process.join, max(0.0, deadline - time.monotonic()))
            if r.process.is_alive():
                log.warning("relay %d did not stop within the grace; killing it", r.index)
                r.process.kill()
                r.process.join(1.0)
            r.conn.close()
        self._running.clear()
        self.discard()

    def discard(self) -> None:
        """Closes the region socket and removes the sockets' directory (what ``stop`` leaves once
        the relays are gone)."""
        self.regions.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def pids(self) -> list[int]:
        return [r.process.pid for r in self._running.values() if r.process.is_alive()]


def _receive(conn):
    try:
        return conn.recv()
    except (EOFError, OSError):
        return ("failed", "the relay process exited while starting")
