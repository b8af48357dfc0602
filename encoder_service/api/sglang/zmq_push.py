"""Where the SGLang front end sends a request's embeddings, what it holds meanwhile, and the ZMQ push.

SGLang's language server names its receivers in one of two ways (as its own encoder server
handles them, ``sglang/srt/disaggregation/encoder/grpc_server.py``):

- in the ``EncodeRequest``: ``prefill_host`` and one or more ``embedding_port`` (the tokenizer's
  PULL socket, ``zmq_to_tokenizer``; or explicit scheduler ports);
- by ``SchedulerReceiveUrl`` calls (``zmq_to_scheduler``): each scheduler TP rank registers its
  ``host:port`` for the ``req_id`` with ``receive_count`` = the number of ranks, before, during or
  after the Encode call; the Encode pushes to every rank once all ``receive_count`` have registered.

``Destinations`` keeps those registrations, each for ``ttl_s`` after it was last used (a request
whose Encode never comes, or the second part of a request sent to this same encoder, finds or
drops them then). Anyone who can reach the port can register, so the table is bounded twice:

- per source (the caller's token on a port that checks tokens, else its IP address): at most
  ``max_per_source`` req_ids; a source over it replaces its own oldest registration, so a flood
  from one host costs only that host's share;
- in all: at most ``max_pending`` req_ids; a full table drops the oldest registration of the
  source holding the most, so a new source always finds room while others flood.

Of a source's registrations, one whose embeddings were delivered goes first, then the oldest.

Registrations an Encode call waits on are never dropped; when nothing else can be, the new one is
RESOURCE_EXHAUSTED, saying so. A req_id takes at most ``receive_count`` receivers (at most
``MAX_RECEIVE_COUNT``). Every target must match ``--allowed-sinks``, like any other push of this
server.

``HeldBytes`` bounds the embeddings computed and not yet delivered (waiting for the ranks to
register, or being pushed): ``--sglang-max-held-bytes`` in all, each for at most
``--sglang-send-timeout-s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from ...errors import RETRY_AFTER_S, InvalidInput, PermissionDenied, ResourceExhausted, Unavailable
from ...sink_allowlist import SinkAllowlist, parse_target

MAX_PENDING_REQUESTS = 4096
MAX_PENDING_PER_SOURCE = 1024
# receive_count is a language server's TP size.
MAX_RECEIVE_COUNT = 256


def checked_endpoint(host_port: str, allowlist: SinkAllowlist, what: str) -> str:
    """``tcp://host:port`` for a receiver ``host:port`` that ``--allowed-sinks`` admits."""
    target = parse_target(host_port, what)
    if not allowlist:
        raise PermissionDenied(f"{what} {host_port!r}: this encoder pushes to no receiver (--allowed-sinks is "
                               "empty); allow the language servers' addresses, e.g. --allowed-sinks '10.0.0.*:*'")
    if allowlist.match(target) is None:
        raise PermissionDenied(f"{what} {host_port!r} is not in this encoder's --allowed-sinks")
    return f"tcp://{target.text}"


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


@dataclass
class _Entry:
    source: str  # who made it: counted against that source's share
    count: int | None = None  # receive_count, once a rank registered
    endpoints: list[str] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    active: int = 0  # Encode calls waiting on it
    delivered: bool = False  # an Encode pushed to its receivers: the first to go when room is needed
    expires: float = 0.0


class Destinations:
    """SchedulerReceiveUrl registrations by req_id (see the module docstring); only the event
    loop's thread touches them."""

    def __init__(self, ttl_s: float, max_pending: int = MAX_PENDING_REQUESTS,
                 max_per_source: int = MAX_PENDING_PER_SOURCE) -> None:
        self.ttl_s = ttl_s
        self.max_pending = max_pending
        self.max_per_source = max_per_source
        self._entries: dict[str, _Entry] = {}
        self._by_source: dict[str, OrderedDict[str, None]] = {}  # source -> its req_ids, oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def count(self, source: str) -> int:
        return len(self._by_source.get(source, ()))

    def _drop(self, req_id: str) -> None:
        entry = self._entries.pop(req_id)
        mine = self._by_source[entry.source]
        del mine[req_id]
        if not mine:
            del self._by_source[entry.source]

    def _oldest_idle(self, source: str) -> str | None:
        """The source's oldest registration no Encode waits on, one already delivered first."""
        oldest = None
        for req_id in self._by_source.get(source, ()):
            entry = self._entries[req_id]
            if entry.active == 0:
                if entry.delivered:
                    return req_id
                oldest = oldest or req_id
        return oldest

    def _make_room(self, source: str) -> None:
        now = time.monotonic()
        for req_id in [k for k, e in self._entries.items() if e.active == 0 and e.expires < now]:
            self._drop(req_id)
        if self.count(source) >= self.max_per_source:
            victim = self._oldest_idle(source)
            if victim is None:
                raise ResourceExhausted(
                    f"{source} has {self.count(source)} requests waiting for their receivers (SchedulerReceiveUrl) "
                    f"or their Encode, all of them in an Encode call; at most {self.max_per_source} a caller",
                    retry_after_s=RETRY_AFTER_S)
            self._drop(victim)
        if len(self._entries) < self.max_pending:
            return
        for holder in sorted(self._by_source, key=self.count, reverse=True):  # the biggest share first
            victim = self._oldest_idle(holder)
            if victim is not None:
                self._drop(victim)
                return
        raise ResourceExhausted(f"{len(self._entries)} requests wait for their receivers (SchedulerReceiveUrl), "
                                f"each in an Encode call; at most {self.max_pending}", retry_after_s=RETRY_AFTER_S)

    def _entry(self, req_id: str, source: str) -> _Entry:
        entry = self._entries.get(req_id)
        if entry is None:
            self._make_room(source)
            entry = self._entries[req_id] = _Entry(source)
            self._by_source.setdefault(source, OrderedDict())[req_id] = None
        entry.expires = time.monotonic() + self.ttl_s
        return entry

    def register(self, req_id: str, endpoint: str, count: int, source: str) -> None:
        if not 0 < count <= MAX_RECEIVE_COUNT:
            raise InvalidInput(f"receive_count must be in 1..{MAX_RECEIVE_COUNT}, got {count}")
        entry = self._entries.get(req_id)
        if entry is not None and entry.count is not None and entry.count != count:
            raise InvalidInput(f"inconsistent receive_count for req_id {req_id!r}: registered {entry.count}, "
                               f"got {count}")
        if entry is not None and endpoint not in entry.endpoints and len(entry.endpoints) >= count:
            raise InvalidInput(f"req_id {req_id!r} already has its {count} receivers (receive_count)")
        entry = self._entry(req_id, source)
        entry.count = count
        if endpoint not in entry.endpoints:
            entry.endpoints.append(endpoint)
        if len(entry.endpoints) >= count:
            entry.ready.set()

    @contextlib.contextmanager
    def expecting(self, req_id: str, source: str) -> Iterator[_Entry]:
        """The entry of req_id, kept (never dropped) while an Encode call is inside this block."""
        entry = self._entry(req_id, source)
        entry.active += 1
        try:
            yield entry
        finally:
            entry.active -= 1
            entry.expires = time.monotonic() + self.ttl_s

    @staticmethod
    async def receivers(entry: _Entry, req_id: str, timeout_s: float, note: str = "") -> list[str]:
        """Every receiver of ``entry``, once ``receive_count`` have registered; ``note`` ends the
        error's message."""
        try:
            await asyncio.wait_for(entry.ready.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            raise Unavailable(f"req_id {req_id!r}: {len(entry.endpoints)} of {entry.count or '?'} receivers "
                              f"registered (SchedulerReceiveUrl) within {timeout_s:g} s {note}".rstrip()) from None
        return list(entry.endpoints)


class HeldBytes:
    """Bytes of embeddings computed and waiting for delivery, bounded by ``budget``."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held = 0

    @contextlib.contextmanager
    def hold(self, n: int) -> Iterator[None]:
        if n > self.budget:
            raise ResourceExhausted(f"this request's embeddings are {n} bytes, more than the {self.budget} bytes "
                                    f"this encoder holds for delivery (--sglang-max-held-bytes {self.budget}); "
                                    "send fewer images per request")
        if self.held + n > self.budget:
            raise ResourceExhausted(f"{self.held} bytes of embeddings already wait for delivery; {n} more would "
                                    f"pass --sglang-max-held-bytes {self.budget}", retry_after_s=RETRY_AFTER_S)
        self.held += n
        try:
            yield
        finally:
            self.held -= n


class ZmqPusher:
    """One PUSH socket per send, as SGLang's encoder does for per-request receivers: connect, send
    the two frames (zero-copy), close with a linger so libzmq finishes the transfer."""

    def __init__(self) -> None:
        self._ctx = zmq.asyncio.Context()

    async def push(self, endpoint: str, frames: list[bytes], timeout_s: float) -> None:
        timeout_s = max(0.001, timeout_s)
        ms = max(1, int(timeout_s * 1000))
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing until the receiver is connected
        sock.setsockopt(zmq.SNDTIMEO, ms)
        try:
            sock.connect(endpoint)
            await asyncio.wait_for(sock.send_multipart(frames, copy=False), timeout_s)
        except (asyncio.TimeoutError, zmq.ZMQError) as exc:
            sock.close(linger=0)
            reason = (f"not connected within {timeout_s:g} s (--sglang-send-timeout-s)"
                      if isinstance(exc, asyncio.TimeoutError) else exc)
            raise Unavailable(f"could not push the embeddings to {endpoint}: {reason}") from None
        sock.close(linger=ms)

    def close(self) -> None:
        self._ctx.destroy(linger=0)
