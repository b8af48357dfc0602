"""A fixed number of slots (decoder processes, decode threads) shared fairly between callers.

A plain FIFO in front of a pool lets one caller who sends many expensive inputs at once hold every
slot while everyone else waits behind all of them. Here a free slot goes, among the waiters, to the
client holding the fewest slots (ties: the one served least recently), and within that client to the
request holding the fewest (ties: the first to arrive). So while others wait, a client gets a slot
only in its turn, whatever it sent.

Turns alone do not help a newcomer when one client already holds every slot with long work (a
clip's decode may take seconds). With ``reserve`` and 3 slots or more, two are held back: the last
free slot goes only to a client that holds none, and the one before it only to a request that holds
none. So one caller's work never has all the slots when another caller's first input comes. The
price: one client alone uses at most all slots but one, so the reserve is for slots held long (the
video decoders); for short work (image decodes) turns suffice.

Waiting is bounded (``max_waiting`` in all, and a share of it per client and per request): past the
bound, ``ResourceExhausted`` with a retry hint. A cancelled waiter leaves the queue at once; a holder
gives its slot back when its work is done (``async with slots.slot(caller)``).

Lives on the event loop; no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..errors import RETRY_AFTER_S, ResourceExhausted

# Each caller's requests are told apart by an id unique in the process.
_request_ids = itertools.count()


@dataclass(frozen=True)
class Caller:
    """Who asks: ``client`` (a bearer token's identity or a peer address; "" for an in-process
    caller) and one of its requests."""

    client: str = ""
    request: int = field(default_factory=lambda: next(_request_ids))


@dataclass(eq=False)
class _Waiter:
    caller: Caller
    arrived: int
    future: asyncio.Future


class FairSlots:
    """``slots`` slots; ``max_waiting`` callers may wait for one (None: no bound); one client may
    have ``client_share`` of that bound waiting and one request ``request_share`` of it. ``what``
    names the slots in the refusal ("video decoders"), ``flag`` the bound's flag; ``reserve``: hold
    the last two free slots back for newcomers (see above)."""

    def __init__(self, slots: int, *, what: str, max_waiting: int | None = None, flag: str = "",
                 client_share: float = 0.75, request_share: float = 0.5, reserve: bool = True) -> None:
        if slots < 1:
            raise ValueError("FairSlots needs at least one slot")
        self.slots, self.what, self.flag = slots, what, flag
        self.reserve = reserve and slots >= 3
        self.max_waiting = max_waiting
        bound = max_waiting if max_waiting is not None else 0
        self._client_bound = max(1, int(bound * client_share))
        self._request_bound = max(1, int(bound * request_share))
        self._free = slots
        self._waiters: list[_Waiter] = []
        self._held_by_client: Counter[str] = Counter()
        self._held_by_request: Counter[int] = Counter()
        self._waiting_by_client: Counter[str] = Counter()
        self._waiting_by_request: Counter[int] = Counter()
        self._last_served: dict[str, int] = {}
        self._turns = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def free(self) -> int:
        return self._free

    def held_by(self, client: str) -> int:
        return self._held_by_client[client]

    @contextlib.asynccontextmanager
    async def slot(self, caller: Caller) -> AsyncIterator[None]:
        await self.acquire(caller)
        try:
            yield
        finally:
            self.release(caller)

    async def acquire(self, caller: Caller) -> None:
        """A slot for ``caller``, once it is its turn; ResourceExhausted (retry hint) over the bounds."""
        waiter = _Waiter(caller, next(self._turns), asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._waiting_by_client[caller.client] += 1
        self._waiting_by_request[caller.request] += 1
        self._dispatch()
        if waiter.future.done():
            return
        try:
            self._check_room(caller)
            await waiter.future
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(caller)  # given a slot in the same moment it was cancelled: hand it on
            else:
                self._forget(waiter)
            raise

    def release(self, caller: Caller) -> None:
        self._free += 1
        for counter, key in ((self._held_by_client, caller.client), (self._held_by_request, caller.request)):
            counter[key] -= 1
            if counter[key] <= 0:
                del counter[key]
        if not self._held_by_client.get(caller.client) and not self._waiting_by_client.get(caller.client):
            self._last_served.pop(caller.client, None)  # a client that left costs no memory
        self._dispatch()

    def _check_room(self, caller: Caller) -> None:
        if self.max_waiting is None:
            return
        over = None
        # Counted with the caller's own waiter, already queued.
        if len(self._waiters) > self.max_waiting:
            over = f"{len(self._waiters) - 1} inputs already wait for the {self.slots} {self.what}"
        elif self._waiting_by_client[caller.client] > self._client_bound:
            over = f"this client already has {self._client_bound} inputs waiting for the {self.what}"
        elif self._waiting_by_request[caller.request] > self._request_bound:
            over = f"this request already has {self._request_bound} inputs waiting for the {self.what}"
        if over is not None:
            raise ResourceExhausted(f"{over}, the most this server lets wait{self.flag and f' ({self.flag})'}; "
                                    "retry later", retry_after_s=RETRY_AFTER_S)

    def _allowed(self, caller: Caller, free: int) -> bool:
        """Whether ``caller`` may take one of ``free`` slots: the held-back ones go to newcomers only."""
        if free < 1:
            return False
        if self.reserve and free == 1:
            return self._held_by_client[caller.client] == 0
        if self.reserve and free == 2:
            return self._held_by_request[caller.request] == 0
        return True

    def _take(self, caller: Caller) -> None:
        self._free -= 1
        self._held_by_client[caller.client] += 1
        self._held_by_request[caller.request] += 1
        self._last_served[caller.client] = next(self._turns)

    def _forget(self, waiter: _Waiter) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
            for counter, key in ((self._waiting_by_client, waiter.caller.client),
                                 (self._waiting_by_request, waiter.caller.request)):
                counter[key] -= 1
                if counter[key] <= 0:
                    del counter[key]
        if not self._waiting_by_client.get(waiter.caller.client) and not self._held_by_client.get(
                waiter.caller.client):
            self._last_served.pop(waiter.caller.client, None)  # a client that left costs no memory

    def _dispatch(self) -> None:
        """Hands free slots to waiters, the fairest first, as long as some waiter may take one."""
        while self._free > 0 and self._waiters:
            # A waiter whose task was cancelled has a cancelled future while it is still listed (its task
            # has not run yet to leave): it takes no slot. Given one, the slot would be lost for good.
            for gone in [w for w in self._waiters if w.future.done()]:
                self._forget(gone)
            allowed = [w for w in self._waiters if self._allowed(w.caller, self._free)]
            if not allowed:
                return
            chosen = min(allowed, key=lambda w: (self._held_by_client[w.caller.client],
                                                 self._last_served.get(w.caller.client, -1),
                                                 self._held_by_request[w.caller.request], w.arrived))
            self._forget(chosen)
            self._take(chosen.caller)
            chosen.future.set_result(None)
