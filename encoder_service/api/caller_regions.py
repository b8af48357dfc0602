"""Callers' shared-memory regions handed over by descriptor: what an ``encoder_client`` on this host
lends by default (``EncodeRequest.output_region.handle``).

A caller on the server's host creates a ``memfd``, reserves its pages, seals it against shrinking
and growing (``F_SEAL_SHRINK | F_SEAL_GROW``) and sends its descriptor over this server's region
socket (an abstract unix socket whose name GetModelInfo gives, ``ModelInfo.region_socket``). The
server checks it, maps it once and answers a handle: 32 random hex digits that name the region in
the caller's later calls.
Each image is then one memory copy into that mapping, without the GIL, where a ``/dev/shm`` object
named in the request (api/shared_memory.py) costs a ``pwrite`` into a descriptor opened for the
call: 0.84 ms less a cached 1008x1008 image (8.8 MB) on the CPU host, paired against pwrite (the
kernel's page-by-page write into tmpfs ran at a quarter of a copy's speed there); with the copies in
pieces, 1.23 ms less on an H200 host (bench/RESULTS.md, 2026-12-02).

Why a mapping is safe here and not for a ``/dev/shm`` object: the caller cannot shrink a sealed
memfd, so no write through the mapping can fall past the object's end (SIGBUS, which would kill the
server). Only a descriptor that ``F_GET_SEALS`` shows sealed against shrinking and growing (and not
yet against further seals) is taken, of exactly the registered size with every page reserved
(``posix_fallocate``: charged to its caller, not to the server that writes it). A regular file, a
pipe, a socket or an unsealed memfd is refused, and so is a hugetlbfs memfd (its block size is not
the page size), whose pages a caller could free under the mapping.

Holes: a page missing under the mapping is one the server's write would allocate (charged to the
server's memory, and with strict overcommit a SIGBUS), and a hole punched while the server writes
into that range stalls the write until the punch ends. So the server, once it has mapped the
region, seals it against writes other than through existing mappings and against further seals
(``F_SEAL_FUTURE_WRITE | F_SEAL_SEAL``): from then on nobody can punch a hole in it (``EPERM``),
the caller's own mapping included, while both mappings read and write as before. Only then are the
pages counted, after the server punched away any pages past the end (which ``st_blocks`` would count:
``fallocate(FALLOC_FL_KEEP_SIZE)`` before sealing puts them there, and the grow seal keeps new ones
out). A kernel without ``F_SEAL_FUTURE_WRITE`` (before Linux 5.1) gets its regions refused. Nothing
in /dev/shm names a region, and nothing is left behind when the caller exits.

Messages on a connection, one datagram each (``SOCK_SEQPACKET``), ASCII:

- caller -> server ``add SIZE`` with one descriptor; server -> caller ``ok HANDLE`` or ``no REASON``;
- caller -> server ``drop HANDLE``: the region is closed (no answer); a call still writing into it
  keeps its own reference to the mapping until it ends.

Registering runs off the event loop (``map_sealed`` in a thread of its own pool): punching the pages
past the end and adding the seal take the memfd's inode lock, which its owner can hold for as long
as it likes (a ``write()`` into it from a buffer whose page fault never completes: userfaultfd, a
FUSE-backed mapping). Such a registration then holds one of ``REGISTER_THREADS`` threads, never the
loop; a connection waits for its ``add``'s answer before the server reads its next message, and at
most ``MAX_PENDING_ADDS`` wait in all (more are refused: the caller falls back to ``/dev/shm``).

A connection closing drops all its regions. Bounds (a hostile local user can connect like any
caller): ``MAX_CONNECTIONS`` connections, ``MAX_REGIONS_PER_CONNECTION`` regions and
``MAX_BYTES_PER_CONNECTION`` bytes on each, ``MAX_REGIONS`` in all (each mapping is one of the
process's ``vm.max_map_count`` mappings, which the model's memory needs too), and never more than an
eighth of the open-file limit in descriptors, connections and regions together (``FDS_PER_REGION``).
A refused registration
costs the caller speed, never an answer: its client falls back to a ``/dev/shm`` object.

The handle is the capability: whoever sends it in a request has the server write that call's
images into the region. It travels only on the caller's own unix connection and in its requests
(loopback), as a ``/dev/shm`` region's key does. The messages and bounds are our own for the same
reason as the relays' (api/relay/regions.py): gRPC carries no descriptor; ``socket.recv_fds`` is the
standard library's SCM_RIGHTS.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import logging
import mmap
import os
import resource
import secrets
import socket
import stat
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .descriptor_socket import DescriptorSocket
from .shared_memory import RegionUnusable, RegionWriter

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
MAX_REGIONS_PER_CONNECTION = 256
MAX_BYTES_PER_CONNECTION = 4 << 30
MAX_REGIONS = 2048
# Descriptors a region holds: before Python 3.13, the duplicate ``mmap`` keeps (none after: the
# mapping alone holds the pages). Connections and regions together take at most this share of the
# process's open-file limit, whatever MAX_CONNECTIONS and MAX_REGIONS say.
FDS_PER_REGION = 0 if sys.version_info >= (3, 13) else 1
FD_LIMIT_SHARE = 8
_MAX_MESSAGE = 128
# Shrinking would make a write through the mapping a SIGBUS; growing would let the caller put pages
# past the end again after the server punched them away (they would count as reserved pages).
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
# What the server adds once it has mapped the region: no hole can be punched from then on (Linux 5.1;
# the fcntl module names it from Python 3.12 on where the headers have it).
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
_SERVER_SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_MAX_FILE_END = (1 << 63) - 1  # tmpfs's largest offset (MAX_LFS_FILESIZE)
MESSAGES_PER_WAKEUP = 16
HANDLE_HEX = 32
REGISTER_THREADS = 2
MAX_PENDING_ADDS = 8


class Refused(Exception):
    """A descriptor the server does not map (the reason goes back to the caller)."""


def _reserved(fd: int, size: int) -> bool:
    """Whether the object's first ``size`` bytes have their pages (its owner reserved them: they are
    charged to it, not to the server that writes them), where no page lies past its end."""
    return os.fstat(fd).st_blocks * 512 >= -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


_libc = None


def _punch_past(fd: int, offset: int) -> None:
    """Frees every page of the object from ``offset`` (a page boundary) on; OSError where it cannot."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, _MAX_FILE_END - offset) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def map_sealed(fd: int, size: int) -> np.ndarray:
    """``size`` bytes of a memfd sealed against shrinking and growing, mapped shared and writable,
    then sealed by the server against holes, with every page reserved; Refused otherwise (see the
    module docstring for what is refused and why)."""
    memory = None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused("not a memfd")
        # hugetlbfs (its block size is the huge page's; st_blksize would be too for tmpfs with huge
        # pages, fstatvfs is not): pages a caller can free under the mapping.
        if os.fstatvfs(fd).f_bsize != mmap.PAGESIZE:
            raise Refused("not a memfd of ordinary pages")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:  # a file, pipe or socket: no seals at all
            raise Refused("not a sealed memfd") from None
        if seals & _SEALS != _SEALS:
            raise Refused("not sealed against shrinking and growing")
        if seals & fcntl.F_SEAL_SEAL:
            raise Refused("sealed against further seals: leave F_SEAL_SEAL off, the server seals it against holes")
        # Read after the seals: the size can no longer change.
        if os.fstat(fd).st_size != size:
            raise Refused("not of its size")
        _punch_past(fd, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
        if sys.version_info >= (3, 13):  # no duplicate of the descriptor: the mapping holds the pages
            memory = mmap.mmap(fd, size, mmap.MAP_SHARED, trackfd=False)
        else:
            memory = mmap.mmap(fd, size, mmap.MAP_SHARED)
        try:  # after the mapping: a write-sealed memfd takes no new writable mapping
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SERVER_SEALS)
        except OSError as exc:
            raise Refused(f"cannot be sealed against holes ({exc.strerror}; Linux 5.1 or later)") from None
        if not _reserved(fd, size):
            raise Refused("pages not reserved (posix_fallocate them first)")
        array = np.frombuffer(memory, np.uint8)
        # Every page mapped now, in this registration thread: a call's first copy into the region would
        # otherwise take a page fault a page (a new 16 MiB region's first copy: 8.4 against 1.4 ms),
        # on whichever thread copies (the event loop's, for a lone call: api/streaming.py).
        int(array[::mmap.PAGESIZE].sum())
        return array
    except (OSError, ValueError) as exc:  # e.g. a memfd sealed against writes, or opened read-only
        if memory is not None:
            memory.close()
        raise Refused(f"cannot be mapped ({getattr(exc, 'strerror', None) or exc})") from None
    except Refused:
        if memory is not None:
            memory.close()
        raise


class _Region:
    """A registered region; its mapping goes with the last reference to ``memory`` (a call may still
    be writing into it when the region is dropped)."""

    def __init__(self, memory: np.ndarray, owner: _Connection) -> None:
        self.memory = memory
        self.owner = owner


def _bounds(soft_fd_limit: int) -> tuple[int, int]:
    """(connections, regions) the server takes with this open-file limit: together at most
    1/FD_LIMIT_SHARE of it in descriptors (a connection holds one; a region FDS_PER_REGION)."""
    if soft_fd_limit == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS, MAX_REGIONS
    budget = max(2, soft_fd_limit // FD_LIMIT_SHARE)
    connections = max(1, min(MAX_CONNECTIONS, budget // 4))
    regions = MAX_REGIONS if FDS_PER_REGION == 0 else (budget - connections) // FDS_PER_REGION
    return connections, max(1, min(MAX_REGIONS, regions))


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.handles: set[str] = set()
        self.bytes = 0
        self.closed = False


class _Pending:
    """An ``add`` being mapped off the loop: its answer comes once that is done (``_added``)."""


class CallerRegions(DescriptorSocket):
    """The regions callers registered, by handle; only the event loop's thread touches it."""

    def __init__(self) -> None:
        # Abstract (no file): gone with the process, and the random part keeps another local user
        # from taking the name first (it is in /proc/net/unix for all to read, as a port is).
        self.name = f"encoder-regions-{os.getpid()}-{secrets.token_hex(8)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        listener.bind("\0" + self.name)
        super().__init__(listener, "region socket")
        self._regions: dict[str, _Region] = {}
        self.max_connections, self.max_regions = _bounds(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self._connections: dict[socket.socket, _Connection] = {}
        self._registering = ThreadPoolExecutor(REGISTER_THREADS, thread_name_prefix="region-register")
        self._pending = 0

    def __len__(self) -> int:
        return len(self._regions)

    def writer(self, handle: str, size: int = 0) -> RegionWriter:
        """The writer of one call into the region ``handle`` names, within its first ``size`` bytes
        (0: all of it); RegionUnusable when no region has that handle (the caller's client then goes
        back to a /dev/shm object: see encoder_client.shared_memory)."""
        region = self._regions.get(handle)
        if region is None:
            raise RegionUnusable("output_region.handle names no region registered with this server (closed, "
                                 "or registered with a server that has since restarted)")
        memory = region.memory  # no hole can appear in it (sealed against them when registered)
        return RegionWriter(memory[:size] if 0 < size < len(memory) else memory)

    # --- the socket ----------------------------------------------------------------------------------
    def _connected(self, sock: socket.socket) -> None:
        if len(self._connections) >= self.max_connections:
            sock.close()  # the caller's client goes back to /dev/shm objects
            return
        conn = _Connection(sock)
        self._connections[sock] = conn
        self._watch(sock, self._read, conn)

    def _disconnect_all(self) -> None:
        for conn in list(self._connections.values()):
            self._disconnect(conn)
        self._registering.shutdown(wait=False, cancel_futures=True)

    def _read(self, conn: _Connection) -> None:
        for _ in range(MESSAGES_PER_WAKEUP):  # a flood on one connection never holds the loop
            try:
                data, fds, flags, _addr = socket.recv_fds(conn.sock, _MAX_MESSAGE, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            try:
                if not data:
                    self._disconnect(conn)
                    return
                if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):  # more descriptors, or a longer message
                    reply = "no message: one descriptor at most, and at most 128 bytes"
                else:
                    reply = self._handle(conn, data.decode("ascii", "replace").split(" "), fds)
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            if isinstance(reply, _Pending):  # answered, and read again, once mapped
                return
            if reply is not None and not self._reply(conn, reply):
                return

    def _handle(self, conn: _Connection, words: list[str], fds: list[int]) -> str | _Pending | None:
        if words[0] == "add" and len(words) == 2:
            if len(fds) != 1:
                return "no descriptor: add takes exactly one"
            try:
                return self._add(conn, words[1], fds)
            except Refused as exc:
                return f"no {exc}"
        if words[0] == "drop" and len(words) == 2:
            region = self._regions.get(words[1])
            if region is not None and region.owner is conn:
                self._forget(words[1])
            return None
        return "no message: add SIZE or drop HANDLE"

    def _add(self, conn: _Connection, size_text: str, fds: list[int]) -> _Pending:
        """Checks the bounds, then maps the descriptor (taken out of ``fds``: closed once mapped) off
        the loop, with this connection's reading paused until the answer."""
        if not (size_text.isascii() and size_text.isdigit()) or int(size_text) <= 0:
            raise Refused("size: a positive integer")
        size = int(size_text)
        if len(conn.handles) >= MAX_REGIONS_PER_CONNECTION or conn.bytes + size > MAX_BYTES_PER_CONNECTION:
            raise Refused(f"room: a connection holds at most {MAX_REGIONS_PER_CONNECTION} regions and "
                          f"{MAX_BYTES_PER_CONNECTION} bytes")
        if len(self._regions) + self._pending >= self.max_regions:
            raise Refused(f"room: the server holds {self.max_regions} regions")
        if self._pending >= MAX_PENDING_ADDS:
            raise Refused(f"room: {MAX_PENDING_ADDS} registrations are being mapped")
        fd = fds.pop()
        self._pending += 1
        self._pause(conn.sock)
        try:
            future = self._registering.submit(map_sealed, fd, size)
        except RuntimeError:  # shut down: the server is stopping
            self._pending -= 1
            os.close(fd)
            raise Refused("room: the server is stopping") from None
        loop = self._loop

        def answer(done: Future) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server has stopped
                loop.call_soon_threadsafe(self._added, conn, fd, size, done)

        future.add_done_callback(answer)
        return _Pending()

    def _added(self, conn: _Connection, fd: int, size: int, done: Future) -> None:
        """On the loop, once ``map_sealed`` ran: the region kept (or refused) and the answer sent."""
        self._pending -= 1
        os.close(fd)
        try:
            memory = done.result()
        except Refused as exc:
            reply = f"no {exc}"
        except BaseException as exc:  # cancelled at shutdown, or a bug: the caller falls back
            reply = f"no cannot be mapped ({type(exc).__name__})"
        else:
            if conn.closed:
                return  # the mapping goes with ``memory``
            handle = secrets.token_hex(HANDLE_HEX // 2)
            self._regions[handle] = _Region(memory, conn)
            conn.handles.add(handle)
            conn.bytes += size
            reply = f"ok {handle}"
        if conn.closed or not self._reply(conn, reply):
            return
        self._watch(conn.sock, self._read, conn)
        self._read(conn)  # what came meanwhile

    def _reply(self, conn: _Connection, reply: str) -> bool:
        """Sends ``reply``; False (the connection ended) where the caller is gone or does not read."""
        try:
            conn.sock.send(reply.encode())
        except OSError:
            self._disconnect(conn)
            return False
        return True

    def _forget(self, handle: str) -> None:
        region = self._regions.pop(handle)
        region.owner.handles.discard(handle)
        region.owner.bytes -= len(region.memory)

    def _disconnect(self, conn: _Connection) -> None:
        if self._connections.pop(conn.sock, None) is None:
            return
        conn.closed = True
        self._unwatch(conn.sock)
        for handle in list(conn.handles):
            self._forget(handle)
