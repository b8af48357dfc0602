"""Shared-memory regions the server writes embeddings into, for a client on the server's host.

With ``EncoderClient(..., shared_memory=True)`` each Encode call lends the server one region, a
POSIX shared-memory object this process created (``/dev/shm/encoder-<pid>-<random>``), and the
server writes each image's rows there instead of streaming them (EncodeRequest.output_region; the
server needs ``--shared-memory on``, its default). The default, ``shared_memory="auto"``, does so
for a target on this host (``same_host_target``: loopback, a unix socket, this host's name) and
goes back to the stream for good at the first sign that the server cannot write there (another
host behind a loopback address, a server with ``--shared-memory off``, a full /dev/shm):
``region_refused``. The client copies each image out into its own array as its
header chunk arrives, so a region is free again when the call returns.

Where the server has a region socket (``ModelInfo.region_socket``, asked once before the first
call), each region is instead a ``memfd`` sealed against shrinking whose descriptor goes to the
server over that socket (``Registrar``, ``SealedRegion``): the server maps it once and copies each
image in, where it must ``pwrite`` a ``/dev/shm`` object for every call (it cannot map an object its
caller may shrink under it), and nothing is left in /dev/shm if this process is killed. A region
the server refuses (its bounds) is a ``/dev/shm`` object instead; a socket that fails, or a call
refused for its registered region (a server restarted since), makes every later region one.
A child forked from a process with a client forgets the regions and the registration it inherited
(the parent's, which the server writes into for the parent's calls) and makes its own /dev/shm objects.

Regions are pooled (a call in flight holds one) and kept mapped: reusing one costs neither page
faults nor a new mapping on either side. A region starts at ``initial_bytes``, grows to what the
largest recent call needed, up to a bound, and shrinks back (an image that does not fit still
arrives, on the stream). A region whose call
failed is unlinked instead of reused: the server may still be writing into it. Regions are unlinked
at ``close()`` and at interpreter exit; a process killed outright leaves its objects in /dev/shm.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import mmap
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from encoder_client.protocol import encoder_pb2

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
NAME_PREFIX = "encoder-"  # the server writes only into objects named so
DEFAULT_INITIAL_BYTES = 16 << 20
# A region never grows past this: the images of a call beyond it come on the stream.
DEFAULT_MAX_REGION_BYTES = 256 << 20
# shared_memory="auto" (the default): regions start small and grow to what calls need, and all of
# a client's hold at most AUTO_MAX_TOTAL_BYTES (beyond, a call streams): a client with hundreds of
# calls in flight must not reserve 16 MiB for each (seen: an open-loop load of small images fell
# from 500 to 120 calls/s creating them).
AUTO_INITIAL_BYTES = 1 << 20
AUTO_MAX_TOTAL_BYTES = 1 << 30
ALIGN = 64  # the server's alignment of each image in a region
KEY_BYTES = 32
HEADER_BYTES = 64  # the region's start, which holds the key; the server writes after it
_GROW_STEP = 1 << 20
REPLY_TIMEOUT_S = 5.0  # the server's answer to a registration (its event loop answers it)
REFUSED_BACKOFF_S = 1.0  # after the server refuses a registration (its bounds), /dev/shm objects this long


def sealing_supported() -> bool:
    """Whether this host can make sealed memfds (Linux); elsewhere regions are /dev/shm objects."""
    try:
        import fcntl
    except ImportError:
        return False
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_SEAL_SHRINK")


def sealed_memfd(size: int) -> int:
    """A memfd of ``size`` bytes, its pages reserved, sealed against shrinking and growing: what the
    server maps (it refuses a memfd it could lose pages of under the mapping). Not against further
    seals: the server, once it has mapped it, seals it against holes (and then against more seals)."""
    import fcntl

    fd = os.memfd_create("encoder-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)  # short of memory: the error is here, not a SIGBUS
        except OSError as err:
            raise OSError(err.errno, f"cannot reserve {size} bytes of shared memory ({err.strerror})") from None
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    except BaseException:
        os.close(fd)
        raise
    return fd


def same_host_target(target: str) -> bool:
    """Whether a gRPC target names this host: a unix socket, a loopback address or ``localhost``,
    or this host's own name (``dns:///``, ``ipv4:`` and ``ipv6:`` prefixes allowed)."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:", "passthrough:///"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            break
    host = target.split(",", 1)[0]
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def region_refused(code_name: str, details: str) -> bool:
    """Whether an Encode failed because the server cannot use the call's region (so the same call
    streamed would pass): FAILED_PRECONDITION or PERMISSION_DENIED naming ``output_region``."""
    return code_name in ("FAILED_PRECONDITION", "PERMISSION_DENIED") and "output_region" in (details or "")


def _unlink(path: str, creator: int) -> None:
    # Only in the process that made it: a child forked since holds a copy of the object that made
    # it, and its exit (or that copy's collection) must not take the parent's region away.
    if os.getpid() == creator:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class MappedRegion:
    """A region mapped in this process: ``size`` bytes of ``memory``, read where a chunk points."""

    size: int
    memory: np.ndarray

    def view(self, offset: int, length: int) -> np.ndarray | None:
        """Bytes [offset, offset + length) of the region, or None if they are not all inside it."""
        if offset < 0 or length < 0 or offset + length > self.size:
            return None
        return self.memory[offset:offset + length]


class OutputRegion(MappedRegion):
    """One shared-memory object of this process, mapped read/write, unlinked by ``close()``."""

    header_bytes = HEADER_BYTES

    def __init__(self, size: int, directory: str = SHM_DIR, prefix: str = NAME_PREFIX) -> None:
        if size <= HEADER_BYTES:
            raise ValueError(f"a shared-memory region needs more than {HEADER_BYTES} bytes, got {size}")
        self.name = f"{prefix}{os.getpid()}-{secrets.token_hex(8)}"
        self.size = size
        path = os.path.join(directory, self.name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        # The proof that this process created it: the server writes only into an object whose
        # first bytes equal the key its request carries (only this user can read them), and never
        # before HEADER_BYTES. Written while the object is still empty, before it has a size: an
        # object sized first holds zeros for a moment, and a caller that names it with a key of
        # zeros then had the server write into it (seen: a watcher on /dev/shm hit 7 of 16).
        self.key = secrets.token_bytes(KEY_BYTES)
        try:
            self._finalizer = weakref.finalize(self, _unlink, path, os.getpid())
            if os.pwrite(fd, self.key, 0) != KEY_BYTES:
                self._finalizer()
                raise OSError(f"cannot write a shared-memory region's key in {directory}")
            try:
                # Reserve the pages now: on a full /dev/shm the error is ours, here, and not a
                # SIGBUS in whichever process first writes past what tmpfs could give.
                os.posix_fallocate(fd, 0, size)
            except OSError as err:
                self._finalizer()
                raise OSError(err.errno, f"cannot reserve {size} bytes of shared memory in {directory} "
                                         f"({err.strerror}); a container's /dev/shm may be too small") from None
            self.memory = np.frombuffer(mmap.mmap(fd, size, mmap.MAP_SHARED), np.uint8)
        finally:
            os.close(fd)

    def proto(self) -> encoder_pb2.SharedMemoryRegion:
        return encoder_pb2.SharedMemoryRegion(name=self.name, size=self.size, key=self.key)

    def close(self) -> None:
        """Unlinks the object; the mapping goes with the last view of it."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


class RegistrationRefused(Exception):
    """The server would not take this region (its bounds): the pool makes a /dev/shm one instead."""


class RegistrarBroken(OSError):
    """The region socket failed (closed, timed out, answered nonsense): no more registrations."""


class Registrar:
    """This client's connection to the server's region socket (``ModelInfo.region_socket``, an
    abstract unix socket: the server and this process share a network namespace, as a loopback
    target says). Thread-safe. OSError: the socket cannot be used (every later region is then a
    /dev/shm object)."""

    def __init__(self, socket_name: str) -> None:
        self._pid = os.getpid()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._sock.settimeout(REPLY_TIMEOUT_S)
            self._sock.connect("\0" + socket_name)
        except BaseException:
            self._sock.close()
            raise
        self._lock = threading.Lock()

    def register(self, fd: int, size: int) -> str:
        """The server's handle for the sealed memfd ``fd`` of ``size`` bytes."""
        if os.getpid() != self._pid:  # a forked child: the connection is its parent's
            raise RegistrarBroken("the region socket belongs to the process this one was forked from")
        try:
            with self._lock:
                socket.send_fds(self._sock, [f"add {size}".encode()], [fd])
                reply = self._sock.recv(128)
        except OSError as exc:  # a late answer would be read as the next one's: the socket is done
            self.close()
            raise RegistrarBroken(f"the server's region socket failed: {exc}") from None
        if not reply:
            raise RegistrarBroken("the server closed its region socket")
        word, _, rest = reply.decode("ascii", "replace").partition(" ")
        if word == "ok" and len(rest) == 32 and all(c in "0123456789abcdef" for c in rest):
            return rest
        if word == "no":
            raise RegistrationRefused(rest)
        raise RegistrarBroken(f"the server's region socket answered {reply[:64]!r}")

    def drop(self, handle: str) -> None:
        """Tells the server the region is closed. Without the lock and without waiting (a drop has no
        answer; one datagram goes whole or not at all): a registration waiting for its answer holds
        the lock for up to REPLY_TIMEOUT_S, and the async client drops regions on its event loop. A
        drop the socket cannot take now is left to the connection's close, which drops them all."""
        if os.getpid() == self._pid:
            with contextlib.suppress(OSError):  # BlockingIOError where the socket is full
                # os.write, not send: a socket with a timeout would first wait up to it to be writable.
                # (Its descriptor is non-blocking: that is how Python implements the timeout.)
                os.write(self._sock.fileno(), f"drop {handle}".encode())

    def close(self) -> None:
        """The server drops every region this connection registered. In a forked child, only the
        child's copy of the descriptor is closed: the connection stays its parent's."""
        if os.getpid() == self._pid:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread waiting for an answer
        with self._lock:
            self._sock.close()


class SealedRegion(MappedRegion):
    """A memfd of this process, sealed against shrinking and growing, mapped read/write and
    registered with the server under ``handle``; images start at offset 0. No name anywhere:
    ``close()`` tells the server, and the memory goes with the last mapping of it."""

    header_bytes = 0

    def __init__(self, size: int, registrar: Registrar) -> None:
        fd = sealed_memfd(size)
        try:
            self.memory = np.frombuffer(mmap.mmap(fd, size, mmap.MAP_SHARED), np.uint8)
            self.handle = registrar.register(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.registrar = registrar
        self.closed = False

    def proto(self) -> encoder_pb2.SharedMemoryRegion:
        return encoder_pb2.SharedMemoryRegion(handle=self.handle, size=self.size)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.registrar.drop(self.handle)


# A region's bytes are copied in up to COPY_SLICES pieces at once, each at least SLICE_MIN_BYTES: one
# thread copies at a fraction of the host's memory bandwidth (an 8.8 MB embedding took 0.95 ms on
# the H200 host's side of a cache hit and 0.84 ms on the client's, py-spy), and numpy releases the
# GIL for each piece. Used on both sides: the client's copy out, the server's copy in. One copy at a
# time goes in pieces; one that finds another under way copies alone: under load the copies already
# run side by side, and more threads taking and dropping the GIL slowed the server's device worker
# (32 clients on the H200: its preprocessing 0.6 -> 1.9 ms an image with every copy in pieces).
COPY_SLICES = 4
SLICE_MIN_BYTES = 1 << 20
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()
_in_pieces = threading.Lock()  # held by the copy now going in pieces


def _after_fork_in_child() -> None:
    # A forked child has none of the pool's threads, and these locks as some thread held them.
    global _copy_pool, _copy_pool_lock, _in_pieces
    _copy_pool, _copy_pool_lock, _in_pieces = None, threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _copy_threads() -> ThreadPoolExecutor:
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            _copy_pool = ThreadPoolExecutor(COPY_SLICES - 1, thread_name_prefix="copy-slices")
        return _copy_pool


def copy_in_slices(count: int, item_bytes: int, copy: Callable[[int, int], None]) -> None:
    """``copy(start, stop)`` over ``range(count)`` items of ``item_bytes`` each, in pieces copied at
    once when there are several megabytes and no other copy goes in pieces now (the calling thread
    copies the first piece). Returns once every piece is done, also when one failed (then raises)."""
    slices = max(1, min(COPY_SLICES, count * item_bytes // SLICE_MIN_BYTES, count))
    if slices == 1 or not _in_pieces.acquire(blocking=False):
        copy(0, count)
        return
    try:
        bounds = [count * i // slices for i in range(slices + 1)]
        others, inline = [], []
        pool = _copy_threads()
        for i in range(1, slices):
            try:
                others.append(pool.submit(copy, bounds[i], bounds[i + 1]))
            except RuntimeError:  # the pool is shut down (interpreter exit): this thread copies it
                inline.append((bounds[i], bounds[i + 1]))
        try:
            copy(bounds[0], bounds[1])
            for start, stop in inline:
                copy(start, stop)
        finally:
            futures.wait(others)
        for future in others:
            future.result()  # raises a piece's error, now that none is still writing
    finally:
        _in_pieces.release()


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class RegionsExhausted(OSError):
    """The pool's regions already hold ``max_total_bytes``: this call goes without one."""


class RegionPool:
    """Regions for concurrent calls (one each), thread-safe.

    A region is sized for the largest call among the last ``SIZE_WINDOW`` (what their images took,
    those that came on the stream included), never below ``initial_bytes`` nor above
    ``max_region_bytes``: it grows at once for a call that outgrew it, and shrinks back once such
    calls stop coming. A region of another size is closed when its call ends. So one call with a
    huge response (many references to one cached image cost a few bytes each to ask for) costs one
    large region for a while, not every region for good. ``max_total_bytes`` bounds what all the
    pool's regions hold at once (None: no bound); ``acquire`` then raises RegionsExhausted.
    ``create(size)`` makes a region (default: an OutputRegion in ``directory`` named ``prefix``...).
    """

    SIZE_WINDOW = 32

    def __init__(self, initial_bytes: int = DEFAULT_INITIAL_BYTES, directory: str = SHM_DIR,
                 prefix: str = NAME_PREFIX, *, max_region_bytes: int = DEFAULT_MAX_REGION_BYTES,
                 max_total_bytes: int | None = None, create: Callable[[int], OutputRegion] | None = None) -> None:
        if initial_bytes <= 0:
            raise ValueError(f"shared_memory_bytes must be positive, got {initial_bytes}")
        if not prefix.startswith(NAME_PREFIX):
            raise ValueError(f"a region's name must start with {NAME_PREFIX!r}, got the prefix {prefix!r}")
        self.initial_bytes = initial_bytes
        self.max_region_bytes = max(initial_bytes, max_region_bytes)
        self.max_total_bytes = max_total_bytes
        self.region_bytes = initial_bytes
        self._create = create or self._new_region
        self._directory, self._prefix = directory, prefix
        self._registrar: Registrar | None = None
        self._register_after = 0.0  # (monotonic) no registration tried before, after a refusal
        self._recent: collections.deque[int] = collections.deque(maxlen=self.SIZE_WINDOW)
        self._free: list[OutputRegion] = []
        self._lock = threading.Lock()
        self._closed = False
        self.live_bytes = 0  # what the pool's regions (free or lent) hold
        self._pid = os.getpid()

    def _forked(self) -> None:
        """In a child forked since the last call (under the lock): the regions and the registration
        are the parent's, whose server writes into them for the parent's calls. Lending one here
        would mix the two processes' embeddings; closing one would take it from the parent. So the
        child forgets them (its copies of the mappings go with it) and makes regions of its own."""
        if os.getpid() == self._pid:
            return
        self._pid = os.getpid()
        self._free, self.live_bytes = [], 0  # regions lent before the fork come back to release: not kept
        self._registrar = None  # its socket is the parent's: /dev/shm objects from now on

    def _ours(self, region: OutputRegion | SealedRegion) -> bool:
        """Whether this process made the region (``acquire`` marks each), not a parent it was forked from."""
        return getattr(region, "_pool_pid", None) == self._pid

    @property
    def registered(self) -> bool:
        """Whether new regions are registered with the server (SealedRegion)."""
        return self._registrar is not None

    def register_with(self, registrar: Registrar) -> None:
        """From now on, regions are sealed memfds registered through ``registrar``."""
        with self._lock:
            self._forked()
            if self._closed:
                registrar.close()
                return
            self._registrar = registrar

    def stop_registering(self) -> None:
        """From now on, regions are /dev/shm objects; the registered ones not lent are closed."""
        with self._lock:
            self._forked()
            registrar, self._registrar = self._registrar, None
            dropped = [r for r in self._free if isinstance(r, SealedRegion)]
            self._free = [r for r in self._free if not isinstance(r, SealedRegion)]
            self.live_bytes -= sum(r.size for r in dropped)
        if registrar is not None:
            registrar.close()  # the server drops them all; a lent one is closed when its call ends

    def _current(self, region: OutputRegion | SealedRegion) -> bool:
        """Whether a region may be lent again: not one registered through a connection since closed
        (the server has dropped its handle)."""
        return not isinstance(region, SealedRegion) or region.registrar is self._registrar

    def _new_region(self, size: int) -> OutputRegion | SealedRegion:
        registrar = self._registrar
        if registrar is not None and time.monotonic() >= self._register_after:
            try:
                return SealedRegion(size, registrar)
            except RegistrationRefused as exc:  # the server's bounds: this one by name
                log.debug("the server refused a shared-memory region (%s); using /dev/shm", exc)
                # and the next ones for a while: each refusal costs a memfd and a round trip first
                self._register_after = time.monotonic() + REFUSED_BACKOFF_S
            except RegistrarBroken as exc:  # (short of memory is another OSError: /dev/shm would fail too)
                log.info("shared-memory regions: registering with the server failed (%s); using /dev/shm "
                         "objects from now on", exc)
                self.stop_registering()
        return OutputRegion(size, self._directory, self._prefix)

    def acquire(self, *, create: bool = True) -> OutputRegion | None:
        """A region for one call: a free one of today's size, else a new one; ``create=False``: None
        instead of making one (the async client makes it off its event loop)."""
        doomed = []
        try:
            with self._lock:
                self._forked()
                if self._closed:
                    raise ValueError("the client is closed")
                while self._free:
                    region = self._free.pop()
                    if region.size == self.region_bytes and self._current(region):
                        return region
                    doomed.append(region)  # sized for other calls than today's
                    self.live_bytes -= region.size
                size = self.region_bytes
                if not create:
                    return None
                if self.max_total_bytes is not None and self.live_bytes + size > self.max_total_bytes:
                    raise RegionsExhausted(f"the regions in use already hold {self.live_bytes} bytes "
                                           f"(at most {self.max_total_bytes})")
                self.live_bytes += size
        finally:
            for region in doomed:
                region.close()
        try:
            region = self._create(size)
        except BaseException:
            with self._lock:
                self.live_bytes -= size
            raise
        region._pool_pid = os.getpid()
        return region

    def release(self, region: OutputRegion, *, needed_bytes: int, failed: bool) -> None:
        """Back to the pool after its call; ``needed_bytes``: what the call's images took (those that
        came on the stream included), which sizes the next regions (see the class docstring)."""
        with self._lock:
            self._forked()
            if not self._ours(region):  # lent by the parent before the fork: its to keep or close
                return
            self._recent.append(needed_bytes)
            need = max(self._recent)
            self.region_bytes = (self.initial_bytes if need <= self.initial_bytes
                                 else min(self.max_region_bytes, -(-need // _GROW_STEP) * _GROW_STEP))
            keep = not (failed or self._closed or region.size != self.region_bytes or not self._current(region))
            if keep:
                self._free.append(region)
            else:
                self.live_bytes -= region.size
        if not keep:
            region.close()

    def close(self) -> None:
        with self._lock:
            self._forked()
            self._closed = True
            free, self._free = self._free, []
            self.live_bytes -= sum(r.size for r in free)
            registrar, self._registrar = self._registrar, None
        for region in free:
            region.close()
        if registrar is not None:
            registrar.close()
