"""Where the SGLang front end sends a request's embeddings, and the ZMQ push itself.

SGLang's language server names its receivers in one of two ways (as its own encoder server
handles them, ``sglang/srt/disaggregation/encoder/grpc_server.py``):

- in the ``EncodeRequest``: ``prefill_host`` and one or more ``embedding_port`` (the tokenizer's
  PULL socket, ``zmq_to_tokenizer``; or explicit scheduler ports);
- by ``SchedulerReceiveUrl`` calls (``zmq_to_scheduler``): each scheduler TP rank registers its
  ``host:port`` for the ``req_id`` with ``receive_count`` = the number of ranks, before, during or
  after the Encode call; the Encode pushes to every rank once all ``receive_count`` have registered.

``Destinations`` keeps those registrations: bounded in number, each kept for ``ttl_s`` after it
was last used (a request whose Encode never comes, or the second part of a request sent to this
same encoder, finds or drops them then). Every target must match ``--allowed-sinks``, like any
other push of this server.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from ..errors import RETRY_AFTER_S, InvalidInput, PermissionDenied, ResourceExhausted, Unavailable
from ..sink_allowlist import SinkAllowlist, parse_target

MAX_PENDING_REQUESTS = 4096


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
    count: int | None = None  # receive_count, once a rank registered
    endpoints: list[str] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    active: int = 0  # Encode calls waiting on it
    expires: float = 0.0


class Destinations:
    """SchedulerReceiveUrl registrations by req_id (see the module docstring)."""

    def __init__(self, ttl_s: float, max_pending: int = MAX_PENDING_REQUESTS) -> None:
        self.ttl_s = ttl_s
        self.max_pending = max_pending
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, req_id: str) -> _Entry:
        now = time.monotonic()
        entry = self._entries.get(req_id)
        if entry is None:
            for key in [k for k, e in self._entries.items() if e.active == 0 and e.expires < now]:
                del self._entries[key]
            if len(self._entries) >= self.max_pending:
                raise ResourceExhausted(f"{len(self._entries)} requests already wait for receivers or an "
                                        f"Encode; at most {self.max_pending}", retry_after_s=RETRY_AFTER_S)
            entry = self._entries[req_id] = _Entry()
        entry.expires = now + self.ttl_s
        return entry

    def register(self, req_id: str, endpoint: str, count: int) -> None:
        entry = self._entry(req_id)
        if entry.count is not None and entry.count != count:
            raise InvalidInput(f"inconsistent receive_count for req_id {req_id!r}: registered {entry.count}, "
                               f"got {count}")
        entry.count = count
        if endpoint not in entry.endpoints:
            entry.endpoints.append(endpoint)
        if len(entry.endpoints) >= count:
            entry.ready.set()

    async def wait(self, req_id: str, timeout_s: float) -> list[str]:
        """Every receiver of req_id, once ``receive_count`` have registered."""
        entry = self._entry(req_id)
        entry.active += 1
        try:
            await asyncio.wait_for(entry.ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise Unavailable(f"req_id {req_id!r}: {len(entry.endpoints)} of {entry.count or '?'} receivers "
                              f"registered (SchedulerReceiveUrl) within {timeout_s:g} s") from None
        finally:
            entry.active -= 1
            entry.expires = time.monotonic() + self.ttl_s
        return list(entry.endpoints)


class ZmqPusher:
    """One PUSH socket per send, as SGLang's encoder does for per-request receivers: connect, send
    the two frames (zero-copy), close with a linger so libzmq finishes the transfer."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context()

    async def push(self, endpoint: str, frames: list[bytes]) -> None:
        ms = int(self.timeout_s * 1000)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing until the receiver is connected
        sock.setsockopt(zmq.SNDTIMEO, ms)
        try:
            sock.connect(endpoint)
            await asyncio.wait_for(sock.send_multipart(frames, copy=False), self.timeout_s)
        except (asyncio.TimeoutError, zmq.ZMQError) as exc:
            sock.close(linger=0)
            reason = f"not connected within {self.timeout_s:g} s" if isinstance(exc, asyncio.TimeoutError) else exc
            raise Unavailable(f"could not push the embeddings to {endpoint}: {reason}") from None
        sock.close(linger=ms)

    def close(self) -> None:
        self._ctx.destroy(linger=0)
