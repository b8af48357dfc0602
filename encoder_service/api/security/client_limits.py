"""Per-client concurrency limit of Encode calls (``--max-requests-per-client``).

A client is its bearer token when the server checks tokens (every replica of one caller shares
it), else the IP address of the connection's peer. Over the limit, a call is refused with
RESOURCE_EXHAUSTED before it reaches the servicer, so one client cannot take the whole admission
queue from the others. The count is taken when the handler starts and given back in a ``finally``
around it: an OK end, an error, the caller cancelling and a deadline (gRPC cancels the handler's
task) all release it. Behind relay processes (``--grpc-processes``) a call whose response a relay
streams from its region is the caller's until the relay has streamed it all (or the caller is
gone): the slot is given back when the relay says so (api/relay/regions.py), not when this
process has written the region, or callers that stop reading could hold any number of calls.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import urllib.parse
from collections import Counter

import grpc

from ...errors import RETRY_AFTER_S, ResourceExhausted
from ...metrics import VISION_ENCODER
from ..interceptor_support import RELAYED_PEER, metadata_value, method_path, wrap_behaviour
from ..relay.regions import RELAY_REGION, RegionBoard
from .auth import client_identity, presented_token

log = logging.getLogger(__name__)

# Encode holds the server's work; Lookup and GetModelInfo answer at once and stay unlimited.
LIMITED_METHODS = frozenset({method_path(VISION_ENCODER.methods_by_name["Encode"])})


def peer_address(peer: str) -> str:
    """The IP address of a gRPC peer string: ``ipv4:10.0.0.3:5123`` -> ``10.0.0.3``,
    ``ipv6:[::1]:5123`` -> ``::1`` (an IPv4-mapped IPv6 address as its IPv4 form); anything else
    (a unix socket) as given."""
    peer = urllib.parse.unquote(peer or "")
    family, _, rest = peer.partition(":")
    if family == "ipv4":
        host = rest.rpartition(":")[0]
    elif family == "ipv6":
        host = rest.rpartition(":")[0].strip("[]")
    else:
        return peer
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def client_of(metadata, peer: str, *, by_token: bool, relayed: bool) -> str:
    """Who a call comes from, for every per-client count (these limits, the fair shares of the
    decoders): its accepted bearer token's identity where the server checks tokens, else the IP
    address of its peer (behind relays, the caller's own, which the relay names). ``metadata``: the
    call's (key, value) pairs."""
    metadata = tuple(metadata or ())
    if by_token:
        token = presented_token(_Details(metadata))
        if token is not None:
            return client_identity(token)
    relayed_peer = metadata_value(_Details(metadata), RELAYED_PEER) if relayed else None
    return "client " + peer_address(relayed_peer or peer)


class _Details:
    """The one field of grpc.HandlerCallDetails the metadata helpers read."""

    def __init__(self, metadata: tuple) -> None:
        self.invocation_metadata = metadata


class ConcurrencyLimits:
    """In-flight counts per client; only the event loop's thread touches them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._in_flight: Counter[str] = Counter()

    def try_acquire(self, client: str) -> bool:
        if self._in_flight[client] >= self.limit:
            return False
        self._in_flight[client] += 1
        return True

    def release(self, client: str) -> None:
        self._in_flight[client] -= 1
        if self._in_flight[client] <= 0:
            del self._in_flight[client]  # a client that left costs no memory

    def in_flight(self, client: str) -> int:
        return self._in_flight.get(client, 0)


class PerClientLimitInterceptor(grpc.aio.ServerInterceptor):
    """Place it after the token interceptor: a token seen here has been accepted."""

    def __init__(self, limit: int, by_token: bool, relayed: bool = False,
                 relay_regions: RegionBoard | None = None, methods: frozenset[str] = LIMITED_METHODS,
                 limits: ConcurrencyLimits | None = None) -> None:
        """``methods``: the paths counted (another port's Encode: the SGLang port's); ``limits``:
        counts shared with another port's interceptor, so a client's calls on both count together."""
        self.limits = limits if limits is not None else ConcurrencyLimits(limit)
        self.methods = methods
        self.by_token = by_token
        # Behind relay processes (--grpc-processes) every call comes from a relay over a private
        # socket; the relay names the caller's own peer in RELAYED_PEER, and the region it lent
        # the call in RELAY_REGION.
        self.relayed = relayed
        self.relay_regions = relay_regions

    def _client(self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext) -> str:
        return client_of(details.invocation_metadata, context.peer(), by_token=self.by_token, relayed=self.relayed)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method not in self.methods:
            return handler
        limits = self.limits

        @contextlib.asynccontextmanager
        async def slot(context: grpc.aio.ServicerContext):
            client = self._client(details, context)  # the peer is known only inside the call
            if not limits.try_acquire(client):
                log.info("%s refused: %s has %d Encode calls in progress", details.method, client, limits.limit)
                raise ResourceExhausted(f"{client} already has {limits.limit} Encode calls in progress, the "
                                        f"most this server allows per client (--max-requests-per-client "
                                        f"{limits.limit}); retry when one has finished", retry_after_s=RETRY_AFTER_S)
            try:
                yield
            finally:
                lend = metadata_value(details, RELAY_REGION) if self.relay_regions is not None else None
                if lend is None:
                    limits.release(client)
                else:  # the relay still streams what this process wrote: until it gives the region back
                    self.relay_regions.after_return(lend, functools.partial(limits.release, client))

        return wrap_behaviour(handler, slot)
