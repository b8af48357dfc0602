"""A listening unix ``SOCK_SEQPACKET`` socket served on the event loop, whose peers may send
descriptors (SCM_RIGHTS): what the relays' regions (api/relay/regions.py) and callers' registered
regions (api/caller_regions.py) share. It accepts, watches each connection and closes them all;
each subclass reads its own messages (``_connected``) and forgets a peer its own way
(``_disconnect``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

log = logging.getLogger(__name__)

BACKLOG = 64


class DescriptorSocket:
    def __init__(self, listener: socket.socket, what: str) -> None:
        """``listener``: bound already; ``what`` names it in the log."""
        self._listener = listener
        self._what = what
        listener.listen(BACKLOG)
        listener.setblocking(False)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._listener.fileno(), self._accept)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            self._loop.remove_reader(self._listener.fileno())
        self._listener.close()
        self._disconnect_all()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("%s: accept failed: %s", self._what, exc)
            return
        sock.setblocking(False)
        self._connected(sock)

    def _watch(self, sock: socket.socket, read, *args) -> None:
        """``read(*args)`` each time ``sock`` has something to read."""
        self._loop.add_reader(sock.fileno(), read, *args)

    def _pause(self, sock: socket.socket) -> None:
        """Stops watching ``sock`` for now (``_watch`` again resumes it); it stays open."""
        if self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(sock.fileno())

    def _unwatch(self, sock: socket.socket) -> None:
        """Stops watching ``sock`` and closes it."""
        self._pause(sock)
        sock.close()

    # --- the subclass's ---------------------------------------------------------------------------------
    def _connected(self, sock: socket.socket) -> None:
        raise NotImplementedError

    def _disconnect_all(self) -> None:
        raise NotImplementedError
