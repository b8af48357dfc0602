"""The relay processes' shared-memory regions (``--grpc-processes``), handed to the server process
by file descriptor: nothing in /dev/shm names them, so no caller can name one (a local user lists
/dev/shm), and nothing is left behind when a relay dies.

A relay (api/relay/process.py) creates each region with ``memfd_create``, reserves its pages and seals its
size (F_SEAL_SHRINK | F_SEAL_GROW: no process can shrink it under the server's mapping, which would
kill the server with SIGBUS), maps it and sends the descriptor to the server process over a
SOCK_SEQPACKET unix socket in the server's private 0700 directory (SCM_RIGHTS). The server checks
the seals and the size, maps it, seals it against holes and answers (``caller_regions.map_sealed``,
as for a caller's region); only then does the relay lend it to
calls, naming it by an opaque key in the call's metadata (``RELAY_REGION``: ``"KEY SEQ"``, SEQ
counting the relay's lends). The relay drops that key from every caller's metadata, and the
server honours it only from its private socket.

Messages, one datagram each, ASCII:

- relay -> server ``add KEY SIZE`` with the descriptor; server -> relay ``ok`` or ``no REASON``;
- relay -> server ``back KEY SEQ``: lend SEQ is over at the relay (its caller has every chunk, or
  is gone). Per-client limits hold the caller's slot until then (api/security/client_limits.py): the server is
  done with a call long before a slow caller has read what the relay streams;
- relay -> server ``drop KEY``: the relay closed the region; the server unmaps it (a call still
  writing keeps its own view until it ends).

A relay's connection closing (it exited or was killed) gives back and drops all its regions.

Why our own: gRPC cannot carry a descriptor, and no library hands memfds between processes;
``socket.send_fds`` / ``recv_fds`` are the standard library's SCM_RIGHTS.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import secrets
import socket
import threading
from collections.abc import Callable

import numpy as np
from encoder_client.shared_memory import MappedRegion

from ..caller_regions import Refused, map_sealed
from ..descriptor_socket import DescriptorSocket

log = logging.getLogger(__name__)

# Metadata the relay sets on a call it lends a region to (and drops from every caller's).
RELAY_REGION = "x-encoder-relay-region"
# F_SEAL_SEAL is the server's to add, after its own seal against holes (caller_regions.map_sealed).
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_MAX_MESSAGE = 256
REPLY_TIMEOUT_S = 5.0


def _key_and_seq(value: str | None) -> tuple[str, int] | None:
    key, _, seq = (value or "").partition(" ")
    if not key or not seq.isascii() or not seq.isdigit():
        return None
    return key, int(seq)


# --- the relay's side ---------------------------------------------------------------------------------

class RelayRegion(MappedRegion):
    """A sealed memfd of the relay, mapped read/write; registered with the server under ``key``."""

    def __init__(self, size: int, on_close: Callable[[RelayRegion], None]) -> None:
        self.key = secrets.token_hex(8)
        self.size = size
        self._on_close = on_close
        # The name shows only in /proc/<pid>/ (as memfd:encoder-relay); it never carries the key.
        self.fd = os.memfd_create("encoder-relay", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            os.posix_fallocate(self.fd, 0, size)  # a full tmpfs fails here, not as a SIGBUS later
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self.memory = np.frombuffer(mmap.mmap(self.fd, size, mmap.MAP_SHARED), np.uint8)
        except BaseException:
            os.close(self.fd)
            raise
        self.closed = False

    def close(self) -> None:
        """Tells the server it is gone; the memory goes with the last mapping of it."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self._on_close(self)


class RegionLender:
    """The relay's end of the server's region socket: creates regions, registers them, says when
    each lend is over. Thread-safe (the relay calls it from its event loop only)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._lends = itertools.count(1)
        # Each connection's regions: a message the server did not get (a send that timed out while
        # its loop was held) ends the connection, and with it every region, lend and per-client slot
        # the server kept for it; later regions go through a new one.
        self._generation = 0
        self._sock: socket.socket | None = self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(REPLY_TIMEOUT_S)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        return sock

    def current(self, region: RelayRegion) -> bool:
        """Whether the server still has ``region`` (registered through today's connection)."""
        return getattr(region, "generation", None) == self._generation

    def create(self, size: int) -> RelayRegion:
        """A new region the server has mapped; OSError when it cannot be had."""
        region = RelayRegion(size, self._dropped)
        try:
            with self._lock:
                if self._sock is None:
                    self._sock = self._connect()
                socket.send_fds(self._sock, [f"add {region.key} {size}".encode()], [region.fd])
                reply = self._sock.recv(_MAX_MESSAGE)
                region.generation = self._generation
        except OSError:
            region.closed = True  # the server may never have seen it: nothing to tell
            os.close(region.fd)
            self._break()  # an answer that comes late would be read as the next one's
            raise
        if reply != b"ok":
            region.closed = True
            os.close(region.fd)
            raise OSError(f"the server refused a relay region: {reply.decode(errors='replace')}")
        return region

    def lend(self, region: RelayRegion) -> str:
        """The metadata value naming ``region`` for one call."""
        return f"{region.key} {next(self._lends)}"

    def give_back(self, lend: str) -> None:
        """The call of ``lend`` is over here."""
        self._send(f"back {lend}")

    def _dropped(self, region: RelayRegion) -> None:
        if self.current(region):  # else the server dropped it with its connection
            self._send(f"drop {region.key}")

    def _send(self, message: str) -> None:
        try:
            with self._lock:
                if self._sock is None:
                    return  # the connection ended: the server forgot everything of it
                self._sock.send(message.encode())
        except OSError as exc:  # the server is gone or stuck: a message lost would hold its slots and mappings
            log.warning("relay regions: cannot tell the server %r (%s); ending the connection, which frees "
                        "every region of it", message.split(" ", 1)[0], exc)
            self._break()

    def _break(self) -> None:
        with self._lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
                self._sock.close()
                self._sock = None
                self._generation += 1

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


# --- the server's side ------------------------------------------------------------------------------

class _Region:
    def __init__(self, memory: np.ndarray, owner: socket.socket) -> None:
        self.memory = memory
        self.owner = owner
        self.returned = 0  # the latest lend the relay gave back
        self.waiting: list[tuple[int, Callable[[], None]]] = []


class RegionBoard(DescriptorSocket):
    """The regions every relay registered, by key; only the event loop's thread touches it."""

    def __init__(self, path: str) -> None:
        self.path = path
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(path)
        os.chmod(path, 0o600)  # the directory is 0700 already; this is the socket's own
        super().__init__(listener, "relay regions")
        self._regions: dict[str, _Region] = {}
        self._connections: dict[socket.socket, set[str]] = {}

    def __len__(self) -> int:
        return len(self._regions)

    def memory(self, lend: str | None) -> np.ndarray | None:
        """The mapped region a call's ``RELAY_REGION`` names, or None (unknown: not lent by a relay)."""
        parsed = _key_and_seq(lend)
        region = self._regions.get(parsed[0]) if parsed else None
        return None if region is None else region.memory

    def after_return(self, lend: str | None, callback: Callable[[], None]) -> None:
        """Runs ``callback`` once the relay has given back ``lend`` (now if it has, or if the lend
        or its region is unknown or gone)."""
        parsed = _key_and_seq(lend)
        region = self._regions.get(parsed[0]) if parsed else None
        if region is None or region.returned >= parsed[1]:
            callback()
        else:
            region.waiting.append((parsed[1], callback))

    # --- the socket ----------------------------------------------------------------------------------
    def _connected(self, conn: socket.socket) -> None:
        self._connections[conn] = set()
        self._watch(conn, self._read, conn)

    def _disconnect_all(self) -> None:
        for conn in list(self._connections):
            self._disconnect(conn)

    def _read(self, conn: socket.socket) -> None:
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(conn, _MAX_MESSAGE, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            if not data:
                for fd in fds:
                    os.close(fd)
                self._disconnect(conn)
                return
            try:
                self._handle(conn, data.decode("ascii", "replace").split(" "), fds)
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def _handle(self, conn: socket.socket, words: list[str], fds: list[int]) -> None:
        if words[0] == "add" and len(words) == 3 and len(fds) == 1:
            reply = self._add(conn, words[1], words[2], fds[0])
            with contextlib.suppress(OSError):
                conn.send(reply.encode())
        elif words[0] == "back" and len(words) == 3 and words[2].isascii() and words[2].isdigit():
            region = self._regions.get(words[1])
            if region is not None and region.owner is conn:
                region.returned = max(region.returned, int(words[2]))
                self._run_waiting(region, region.returned)
        elif words[0] == "drop" and len(words) == 2:
            region = self._regions.get(words[1])
            if region is not None and region.owner is conn:
                self._forget(words[1])
        else:
            log.warning("relay regions: unknown message %r", " ".join(words)[:64])

    def _add(self, conn: socket.socket, key: str, size_text: str, fd: int) -> str:
        if key in self._regions or not key.isalnum():
            return "no key in use"
        if not (size_text.isascii() and size_text.isdigit()) or int(size_text) <= 0:
            return "no size"
        try:
            memory = map_sealed(fd, int(size_text))  # the checks callers' registered regions get
        except Refused as exc:
            return f"no {exc}"
        self._regions[key] = _Region(memory, conn)
        self._connections[conn].add(key)
        return "ok"

    def _run_waiting(self, region: _Region, upto: int) -> None:
        due = [cb for seq, cb in region.waiting if seq <= upto]
        region.waiting = [(seq, cb) for seq, cb in region.waiting if seq > upto]
        for callback in due:
            callback()

    def _forget(self, key: str) -> None:
        region = self._regions.pop(key)
        self._connections.get(region.owner, set()).discard(key)
        self._run_waiting(region, float("inf"))

    def _disconnect(self, conn: socket.socket) -> None:
        keys = self._connections.pop(conn, set())
        self._unwatch(conn)
        for key in list(keys):
            if key in self._regions:
                self._forget(key)
