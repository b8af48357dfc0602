"""Engine admission: a bounded queue refused at once, cancellation and deadlines free their slots."""

from __future__ import annotations

import asyncio

import pytest
from engine_helpers import encode_all, forwards, hold_worker, joins, patches, running_engine, sample, until

from encoder_service.errors import ResourceExhausted, Unavailable

pytestmark = pytest.mark.timeout(60)


def abandoned(engine) -> float:
    return sample(engine, "encoder_service_images_abandoned_total")


def test_full_queue_is_refused_at_once(fake_model):
    async def main():
        async with running_engine(fake_model, max_queue_images=2) as engine:
            blocker = await hold_worker(engine, fake_model)
            assert engine.queued_images == 0  # an image inside a forward no longer waits
            waiting = asyncio.create_task(encode_all(engine, [patches(0, seed=1), patches(1, seed=2)]))
            await until(lambda: engine.queued_images == 2)
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(ResourceExhausted, match=r"queue full: 2 images waiting.*--max-queue-images 2"):
                await encode_all(engine, [patches(0, seed=3)])
            # Generous for a loaded CI machine: a request that waited for a slot would wait for the gate.
            assert loop.time() - started < 10.0
            # Cached or in-flight images take no slot: joining the waiting request is admitted.
            joiner = asyncio.create_task(encode_all(engine, [patches(0, seed=1)]))
            await until(lambda: joins(engine) == 1)
            fake_model.gate.set()
            await asyncio.gather(blocker, waiting, joiner)
            assert engine.queued_images == 0
            assert len(await encode_all(engine, [patches(0, seed=3)])) == 1

    asyncio.run(main())


def test_request_with_more_new_images_than_the_queue_allows_is_refused(fake_model):
    async def main():
        async with running_engine(fake_model, max_queue_images=2) as engine:
            with pytest.raises(ResourceExhausted, match="3 new images"):
                await encode_all(engine, [patches(i, seed=i) for i in range(3)])
            assert engine.queued_images == 0 and fake_model.batches == []

    asyncio.run(main())


def test_cancelled_request_frees_its_slots_and_its_images_are_never_encoded(fake_model):
    async def main():
        async with running_engine(fake_model, max_queue_images=2) as engine:
            blocker = await hold_worker(engine, fake_model)
            waiting = asyncio.create_task(encode_all(engine, [patches(0, seed=1), patches(1, seed=2)]))
            await until(lambda: engine.queued_images == 2)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            assert engine.queued_images == 0 and abandoned(engine) == 2
            fake_model.gate.set()
            await blocker
            await encode_all(engine, [patches(0, seed=3)])
            assert fake_model.batches == [[(1, 4, 4)], [(1, 4, 4)]]  # the blocker and seed 3 only

    asyncio.run(main())


def test_deadline_passing_while_queued_stops_the_work(fake_model):
    async def main():
        async with running_engine(fake_model) as engine:
            blocker = await hold_worker(engine, fake_model)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(encode_all(engine, [patches(0, seed=1)]), timeout=0.2)
            assert engine.queued_images == 0 and abandoned(engine) == 1
            fake_model.gate.set()
            await blocker
            assert len(fake_model.batches) == 1

    asyncio.run(main())


def test_cancelling_one_waiter_keeps_the_image_for_another(fake_model):
    async def main():
        async with running_engine(fake_model) as engine:
            blocker = await hold_worker(engine, fake_model)
            first = asyncio.create_task(encode_all(engine, [patches(0, seed=1)]))
            second = asyncio.create_task(encode_all(engine, [patches(0, seed=1)]))
            await until(lambda: joins(engine) == 1 and engine.queued_images == 1)
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            assert engine.queued_images == 1 and abandoned(engine) == 0
            fake_model.gate.set()
            (result,) = await second
            await blocker
            assert not result.cache_hit and len(fake_model.batches) == 2

    asyncio.run(main())


def test_cancel_after_the_forward_started_still_caches_the_result(fake_model):
    async def main():
        async with running_engine(fake_model) as engine:
            fake_model.gate.clear()
            task = asyncio.create_task(encode_all(engine, [patches(0, seed=1)]))
            assert await asyncio.to_thread(fake_model.entered.wait, 5)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            fake_model.gate.set()
            await until(lambda: forwards(engine) == 1)
            (again,) = await encode_all(engine, [patches(0, seed=1)])
            assert again.cache_hit and len(fake_model.batches) == 1

    asyncio.run(main())


def test_stopped_engine_refuses_new_work(fake_model):
    async def main():
        async with running_engine(fake_model) as engine:
            await engine.stop()
            with pytest.raises(Unavailable, match="draining"):
                await encode_all(engine, [patches(0)])

    asyncio.run(main())
