"""The socket between the server and a video decode process, read by the server as if the child were hostile.

A decode process runs FFmpeg on caller bytes, so a crafted clip may take it over. What it sends back must
then be unable to do more than spoil the answers it gives (its clip's, and those of the clips it decodes
later: a taken-over child is not known as such; README's threat model):

- **No pickles from the child.** ``multiprocessing.Connection.recv`` unpickles, and unpickling runs
  whatever the bytes name (``os.system`` included). The child answers with one JSON object, at most
  ``MAX_ANSWER_BYTES``, that the server type-checks field by field (``video_pool.clip_from_answer``).
- **Every read and write has a deadline.** ``Connection.poll`` only says that a first byte is there; a
  child that announces a long message and stalls would hold a server thread for ever inside
  ``recv``. Here each step polls the descriptor for what time is left, then moves what is there
  without blocking; past the deadline the call raises ``TimeoutError`` and the server kills the child.
- **Frames come as a sealed memfd, not through the socket.** A 10 s 720p clip's sampled frames are
  55 MB: the server maps them instead of copying them through the socket and unpickling them. It takes
  only a memfd sealed against writes, shrinking and growing (``F_GET_SEALS``: a regular file, a pipe
  or a ``/dev/shm`` name has no such seals) of exactly the announced size, so the child can neither
  change the frames once the server reads them nor turn a read into SIGBUS by shrinking the file. The
  server's mapping is private (copy on write): nothing it does reaches the child.

The server sends jobs the other way in the same framing (an 8-byte length, then the body); the body
is a pickle there, which only the server writes.
"""

from __future__ import annotations

import array
import fcntl
import json
import mmap
import os
import select
import socket
import struct
import sys
import time

import numpy as np

MAX_ANSWER_BYTES = 64 * 1024  # a JSON answer: the facts, the indices (<= --max-video-frames), a message
_LENGTH = struct.Struct("!Q")
_FD_SPACE = socket.CMSG_SPACE(array.array("i", [0]).itemsize)  # room for one descriptor, no more
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class BadAnswer(Exception):
    """The child broke the protocol: the server kills and replaces it."""


class Channel:
    """One end of the socketpair under a ``multiprocessing`` Pipe(duplex=True) (its own duplicate of the
    descriptor, left in blocking mode: each call polls, then reads or writes with MSG_DONTWAIT)."""

    def __init__(self, fileno: int) -> None:
        self.sock = socket.socket(fileno=os.dup(fileno))

    def close(self) -> None:
        self.sock.close()

    def has_input(self) -> bool:
        """Whether bytes (or the peer's end) wait to be read now: between calls, a child sends nothing."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(0))

    def _wait(self, events: int, deadline: float | None) -> None:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError
        poller = select.poll()
        poller.register(self.sock, events)
        ready = poller.poll(None if left is None else max(1, int(left * 1000)))
        if not ready:
            raise TimeoutError
        if ready[0][1] & (select.POLLERR | select.POLLNVAL) and not ready[0][1] & events:
            raise EOFError

    def send(self, body, deadline: float | None = None, fd: int | None = None) -> None:
        """``body`` (bytes, or a list of bytes-like parts sent as one message) framed by its length;
        ``fd`` rides with the first bytes (SCM_RIGHTS). The parts go out as buffers of one sendmsg,
        never concatenated: a job is up to --max-video-bytes, and a copy of it would cost the server
        that much again."""
        parts = [memoryview(part).cast("B") for part in (body if isinstance(body, list) else [body])]
        views = [memoryview(_LENGTH.pack(sum(len(part) for part in parts))), *parts]
        ancillary = [] if fd is None else [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        while views:
            self._wait(select.POLLOUT, deadline)
            try:
                sent = self.sock.sendmsg(views, ancillary, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError) as e:
                raise EOFError from e
            ancillary = []
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if views:
                views[0] = views[0][sent:]

    def receive(self, max_bytes: int, deadline: float | None = None) -> tuple[bytes, int | None]:
        """One framed message and the descriptor that came with its first bytes, if any (the caller
        owns it). BadAnswer past ``max_bytes``, EOFError when the peer is gone, TimeoutError."""
        fds: list[int] = []
        try:
            header = self._read(_LENGTH.size, deadline, fds)
            (size,) = _LENGTH.unpack(header)
            if size > max_bytes:
                raise BadAnswer(f"a message of {size} bytes, over the {max_bytes} allowed")
            body = self._read(size, deadline, None)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if len(fds) > 1:  # cannot happen with room for one; closed all the same
            for fd in fds[1:]:
                os.close(fd)
        return body, (fds[0] if fds else None)

    def _read(self, size: int, deadline: float | None, fds: list[int] | None) -> bytes:
        chunks, got = [], 0
        while got < size:
            self._wait(select.POLLIN, deadline)
            try:
                if fds is None:  # descriptors sent with these bytes are dropped (closed) by the kernel
                    data = self.sock.recv(min(size - got, 1 << 20), socket.MSG_DONTWAIT)
                else:
                    data, ancillary, _flags, _addr = self.sock.recvmsg(size - got, _FD_SPACE, socket.MSG_DONTWAIT)
                    for level, kind, payload in ancillary:
                        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                            usable = len(payload) - len(payload) % 4
                            fds.extend(array.array("i", payload[:usable]))
            except BlockingIOError:
                continue
            except ConnectionResetError as e:
                raise EOFError from e
            if not data:
                raise EOFError
            chunks.append(data)
            got += len(data)
        return b"".join(chunks)


def send_json(channel: Channel, answer: dict, fd: int | None = None) -> None:
    channel.send(json.dumps(answer).encode(), None, fd)


def receive_json(channel: Channel, deadline: float) -> tuple[dict, int | None]:
    """The child's answer: a JSON object and the descriptor that came with it. BadAnswer when it is not."""
    body, fd = channel.receive(MAX_ANSWER_BYTES, deadline)
    try:
        answer = json.loads(body, parse_constant=_no_constant)
    except Exception as e:  # not UTF-8, not JSON, NaN, nested past the parser's recursion limit...
        if fd is not None:
            os.close(fd)
        raise BadAnswer(f"an answer that is not JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(answer, dict):
        if fd is not None:
            os.close(fd)
        raise BadAnswer(f"an answer that is a JSON {type(answer).__name__}, not an object")
    return answer, fd


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def sealed_frames(frames: np.ndarray) -> int:
    """The child's side: ``frames`` copied into a new memfd, sealed; the caller sends and closes it."""
    data = memoryview(np.ascontiguousarray(frames)).cast("B")
    fd = os.memfd_create("clip-frames", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, len(data))
        written = 0
        while written < len(data):
            written += os.pwrite(fd, data[written:], written)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def frames_from_memfd(fd: int, shape: tuple[int, int, int, int]) -> np.ndarray:
    """The server's side: uint8 frames of ``shape`` mapped (privately) from the child's sealed memfd.
    Takes ownership of ``fd`` (closed here; the mapping keeps what it needs). BadAnswer when the
    descriptor is not a memfd sealed against writes, shrinking and growing, of exactly that size."""
    try:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise BadAnswer("the frames came in a descriptor that is not a memfd") from None
        if seals & _SEALS != _SEALS:
            raise BadAnswer(f"the frames' memfd is not sealed against writes, shrinking and growing (seals {seals:#x})")
        size = os.fstat(fd).st_size
        expected = int(np.prod(shape, dtype=np.int64))
        if size != expected:
            raise BadAnswer(f"the frames' memfd holds {size} bytes; frames of shape {list(shape)} are {expected}")
        if size == 0:
            return np.empty(shape, np.uint8)
        try:
            # From Python 3.13 the mapping need not keep a duplicate of the descriptor open.
            extra = {"trackfd": False} if sys.version_info >= (3, 13) else {}
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY, **extra)
        except (OSError, ValueError) as e:
            raise BadAnswer(f"the frames' memfd cannot be mapped ({e})") from None
    finally:
        os.close(fd)
    return np.frombuffer(mapping, np.uint8).reshape(shape)
