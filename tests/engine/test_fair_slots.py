"""FairSlots: who gets the next decoder (or decode thread), and how many may wait."""

from __future__ import annotations

import asyncio

import pytest

from encoder_service.engine.fair_slots import Caller, FairSlots
from encoder_service.errors import ResourceExhausted


async def _holders(slots: FairSlots, callers: list[Caller]) -> tuple[list[Caller], list[asyncio.Task]]:
    """Starts an acquire for each caller in order; returns those that got a slot at once, and the
    tasks of those still waiting."""
    got: list[Caller] = []
    tasks = []
    for caller in callers:
        task = asyncio.ensure_future(slots.acquire(caller))
        task.add_done_callback(lambda t, c=caller: t.cancelled() or t.exception() or got.append(c))
        tasks.append(task)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    return got, [t for t in tasks if not t.done()]


def test_a_free_slot_goes_to_the_client_holding_fewest_not_the_first_in_line():
    async def scenario():
        slots = FairSlots(2, what="decoders")
        flood = Caller("A")
        got, _ = await _holders(slots, [flood, flood, flood, flood])
        assert got == [flood, flood]
        victim = Caller("B")
        got2, waiting = await _holders(slots, [victim])
        assert got2 == []  # both held: it waits, but it is next
        order = []
        slots.release(flood)
        await asyncio.sleep(0)
        order.append(slots.held_by("B"))
        assert order == [1]
        for task in waiting:
            assert task.done()
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()

    asyncio.run(scenario())


def test_with_three_slots_one_request_never_holds_the_last_two():
    async def scenario():
        slots = FairSlots(3, what="decoders")
        request = Caller("A")
        got, _waiting = await _holders(slots, [request] * 3)
        assert len(got) == 1  # the one before last goes only to a request holding none
        other_request = Caller("A")
        got2, _ = await _holders(slots, [other_request])
        assert got2 == [other_request]  # a new request of the same client takes the one before last
        third = Caller("A")
        got3, _ = await _holders(slots, [third])
        assert got3 == []  # the last goes only to a client holding none
        newcomer = Caller("B")
        got4, _ = await _holders(slots, [newcomer])
        assert got4 == [newcomer]
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()

    asyncio.run(scenario())


def test_without_reserve_one_client_may_use_every_slot():
    async def scenario():
        slots = FairSlots(4, what="threads", reserve=False)
        got, _ = await _holders(slots, [Caller("A")] * 4)
        assert len(got) == 4

    asyncio.run(scenario())


def test_waiting_is_bounded_with_a_retry_hint_per_request_and_client():
    async def scenario():
        slots = FairSlots(1, what="video decoders", max_waiting=8, flag="--max-video-decodes-waiting")
        request = Caller("A")
        await slots.acquire(Caller("X"))
        waiting = [asyncio.ensure_future(slots.acquire(request)) for _ in range(5)]
        await asyncio.sleep(0)
        refused = [t for t in waiting if t.done()]
        assert len(refused) == 1  # half of 8 per request: the fifth is refused
        error = refused[0].exception()
        assert isinstance(error, ResourceExhausted) and error.retry_after_s is not None
        assert "--max-video-decodes-waiting" in error.message
        more = [asyncio.ensure_future(slots.acquire(Caller("A"))) for _ in range(3)]
        await asyncio.sleep(0)
        assert sum(t.done() for t in more) == 1  # 3/4 of 8 per client: 6 wait, the seventh is refused
        others = [asyncio.ensure_future(slots.acquire(Caller(f"C{i}"))) for i in range(3)]
        await asyncio.sleep(0)
        assert sum(t.done() for t in others) == 1  # 8 in all
        for task in waiting + more + others:
            task.cancel()

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_and_its_slot_goes_to_the_next():
    async def scenario():
        slots = FairSlots(1, what="decoders")
        await slots.acquire(Caller("A"))
        gone = asyncio.ensure_future(slots.acquire(Caller("B")))
        stays = asyncio.ensure_future(slots.acquire(Caller("C")))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        assert slots.waiting == 1
        slots.release(Caller("A"))
        await asyncio.wait_for(stays, 1)
        assert slots.held_by("C") == 1 and slots.held_by("B") == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("slots_count", [1, 2, 3, 5])
def test_every_waiter_gets_a_slot_once_all_are_released(slots_count):
    async def scenario():
        slots = FairSlots(slots_count, what="decoders")
        callers = [Caller(f"client {i % 3}") for i in range(20)]

        async def use(caller):
            async with slots.slot(caller):
                await asyncio.sleep(0.001)

        await asyncio.wait_for(asyncio.gather(*(use(c) for c in callers)), 5)
        assert slots.free == slots_count and slots.waiting == 0

    asyncio.run(scenario())


def test_a_waiter_cancelled_just_before_a_release_takes_no_slot():
    """The race a storm of cancellations hits: a waiter's task is cancelled (its future with it), and
    before that task runs, a holder releases. The slot must go to the next waiter, not be lost to the
    cancelled one (every later caller would then wait for ever)."""
    async def scenario():
        slots = FairSlots(1, what="decode threads", reserve=False)
        holder = Caller("A")
        await slots.acquire(holder)
        gone = asyncio.ensure_future(slots.acquire(Caller("B")))
        stays = asyncio.ensure_future(slots.acquire(Caller("C")))
        await asyncio.sleep(0)  # both waiting
        gone.cancel()  # cancels the future it awaits at once; its task leaves only when it next runs...
        slots.release(holder)  # ...and the holder releases before that
        await asyncio.wait_for(stays, 1)
        assert gone.cancelled()
        assert slots.held_by("C") == 1 and slots.held_by("B") == 0 and slots.waiting == 0
        slots.release(Caller("C"))
        assert slots.free == 1

    asyncio.run(scenario())
