"""A clip larger than one forward, through the engine with the fake model (whose time steps encode
independently, as Qwen's do): cut into parts of whole steps, one result equal to the whole clip's; a
caller that leaves drops the parts not yet run; one step over the bound is refused."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_helpers import encode_all, patches, running_engine, sample, until

from encoder_service.errors import ResourceExhausted

pytestmark = pytest.mark.timeout(60)

GRID = (6, 4, 4)  # 6 time steps of 16 patches


def test_a_clip_over_the_bound_runs_in_parts_and_equals_the_whole(fake_model):
    async def main():
        async with running_engine(fake_model, max_batch_tokens=40) as engine:
            (r,) = await encode_all(engine, [patches(0, GRID, seed=4)])
            assert fake_model.batches == [[(2, 4, 4)], [(2, 4, 4)], [(2, 4, 4)]]  # 2 steps (32 patches) a part
            assert r.grid == GRID and r.num_tokens == 24
            assert sample(engine, "encoder_service_images_encoded_total", device="cpu") == 1  # one clip
            assert sample(engine, "encoder_service_tokens_encoded_total") == 24
            torch.testing.assert_close(r.embedding, fake_model.reference(fake_model.patches(GRID, 4)), rtol=0, atol=0)
            (again,) = await encode_all(engine, [patches(0, GRID, seed=4)])
            assert again.cache_hit and len(fake_model.batches) == 3

    asyncio.run(main())


def test_a_caller_leaving_a_split_clip_drops_its_parts_not_yet_run(fake_model):
    async def main():
        async with running_engine(fake_model, max_batch_tokens=16) as engine:
            fake_model.gate.clear()
            fake_model.entered.clear()
            task = asyncio.create_task(encode_all(engine, [patches(0, GRID, seed=5)]))
            assert await asyncio.to_thread(fake_model.entered.wait, 5)  # the first part is in its forward
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: sample(engine, "encoder_service_images_abandoned_total") == 1)
            fake_model.gate.set()
            await until(lambda: not engine.busy)
            assert fake_model.batches == [[(1, 4, 4)]]  # the other five parts never ran
            assert len(engine.cache) == 0
            (r,) = await encode_all(engine, [patches(0, GRID, seed=5)])  # asked again: computed afresh
            assert not r.cache_hit and len(fake_model.batches) == 7

    asyncio.run(main())


def test_a_clip_whose_one_step_is_over_the_bound_is_refused(fake_model):
    async def main():
        async with running_engine(fake_model, max_batch_tokens=12) as engine:
            with pytest.raises(ResourceExhausted, match=r"clip has 96 patches.*1 of its 6 time steps, 16 patches"):
                engine.check_grid(list(GRID))
            assert engine.check_grid([3, 2, 2]) == (3, 2, 2)  # 12 patches: one forward

    asyncio.run(main())


def test_a_split_clip_holds_its_admission_slot_until_its_last_part_starts(fake_model):
    # Its parts not yet run are work waiting: counting the clip as in a forward from its first part
    # on would admit more than --max-queue-images while most of it still waits.
    async def main():
        async with running_engine(fake_model, max_batch_tokens=16, max_queue_images=1) as engine:
            fake_model.gate.clear()
            fake_model.entered.clear()
            task = asyncio.create_task(encode_all(engine, [patches(0, GRID, seed=6)]))
            assert await asyncio.to_thread(fake_model.entered.wait, 5)  # its first part is in a forward
            assert engine.queued_images == 1
            with pytest.raises(ResourceExhausted, match="queue full: 1 images waiting"):
                await encode_all(engine, [patches(1, seed=7)])
            fake_model.gate.set()
            (r,) = await task
            assert r.grid == GRID and len(fake_model.batches) == 6 and engine.queued_images == 0

    asyncio.run(main())


def test_a_split_clip_whose_part_fails_gives_its_slot_back(fake_model):
    async def main():
        async with running_engine(fake_model, max_batch_tokens=16, max_queue_images=1) as engine:
            fake_model.fail_forward = 2  # the clip's second part
            with pytest.raises(RuntimeError, match="forward 2 failed"):
                await encode_all(engine, [patches(0, GRID, seed=8)])
            await until(lambda: not engine.busy)
            assert engine.queued_images == 0
            (r,) = await encode_all(engine, [patches(1, seed=9)])  # the one slot is free again
            assert r.grid == (1, 4, 4)

    asyncio.run(main())
