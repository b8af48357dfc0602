"""Engine in-process with a fake model: results, cache hits, in-flight de-duplication, batching."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_helpers import encode_all, encoded, forwards, hold_worker, joins, patches, running_engine, sample, until

from encoder_service.engine import ImageInput
from encoder_service.errors import InvalidInput, ResourceExhausted

pytestmark = pytest.mark.timeout(60)


def test_embedding_equals_the_model_on_the_same_patches(fake_model):
    async def main():
        async with running_engine(fake_model) as engine:
            (r,) = await encode_all(engine, [patches(0, (2, 4, 6), seed=3)])
            expected = fake_model.reference(fake_model.patches((2, 4, 6), 3))
            assert r.grid == (2, 4, 6) and r.num_tokens == 12 and r.hidden_size == 8
            torch.testing.assert_close(r.embedding, expected, rtol=0, atol=0)
            assert r.embedding.device.type == "cpu"
            # Stored tensors own their storage (a view would keep the whole batch output alive).
            assert r.embedding.untyped_storage().nbytes() == r.embedding.nbytes
            assert fake_model.warmups == 2  # two token counts (DeviceWorker._run_warmup)

    asyncio.run(main())


def test_second_encode_of_same_image_is_a_cache_hit_and_runs_no_forward(fake_model):
    async def main():
        async with running_engine(fake_model) as engine:
            (first,) = await encode_all(engine, [encoded(0)])
            after_first = forwards(engine)
            (second,) = await encode_all(engine, [encoded(0)])
            assert not first.cache_hit and second.cache_hit
            assert forwards(engine) == after_first == 1
            assert sample(engine, "encoder_service_cache_hits_total") == 1
            assert sample(engine, "encoder_service_cache_misses_total") == 1
            assert first.content_hash == second.content_hash
            torch.testing.assert_close(first.embedding, second.embedding, rtol=0, atol=0)
            (by_hash,) = await encode_all(engine, [ImageInput(0, "content_hash", content_hash=first.content_hash)])
            assert by_hash.cache_hit and engine.lookup([first.content_hash, "nope"]) == [True, False]

    asyncio.run(main())


def test_two_engines_in_one_process_count_apart(fake_model):
    from fake_model import FakeVisionModel

    async def main():
        async with running_engine(fake_model) as a, running_engine(FakeVisionModel()) as b:
            await encode_all(a, [encoded(0, seed=1), encoded(1, seed=2)])
            await encode_all(b, [encoded(0, seed=1)])
            await encode_all(b, [encoded(0, seed=1)])
            misses, hits = "encoder_service_cache_misses_total", "encoder_service_cache_hits_total"
            assert (sample(a, misses), sample(a, hits)) == (2, 0)
            assert (sample(b, misses), sample(b, hits)) == (1, 1)
            assert sample(a, "encoder_service_images_total", source="encoded", model="fake") == 2
            assert sample(b, "encoder_service_images_total", source="encoded", model="fake") == 2

    asyncio.run(main())


def test_16_concurrent_requests_for_the_same_new_image_run_one_forward(fake_model):
    async def main():
        async with running_engine(fake_model) as engine:
            fake_model.gate.clear()
            tasks = [asyncio.create_task(encode_all(engine, [patches(0, seed=5)])) for _ in range(16)]
            await until(lambda: joins(engine) == 15)
            fake_model.gate.set()
            results = [r for rs in await asyncio.gather(*tasks) for r in rs]
            assert len(fake_model.batches) == 1 and forwards(engine) == 1
            assert len({r.content_hash for r in results}) == 1
            for r in results:
                torch.testing.assert_close(r.embedding, results[0].embedding, rtol=0, atol=0)
            assert engine.cache.peek(results[0].content_hash).pins == 0  # every stream unpinned

    asyncio.run(main())


def test_images_of_concurrent_requests_share_one_forward(fake_model):
    async def main():
        async with running_engine(fake_model) as engine:
            blocker = await hold_worker(engine, fake_model)
            tasks = [asyncio.create_task(encode_all(engine, [patches(0, seed=s)])) for s in (1, 2, 3)]
            await until(lambda: len(engine._queue) == 3)  # queued for a forward, not still being prepared
            fake_model.gate.set()
            await asyncio.gather(blocker, *tasks)
            assert fake_model.batches == [[(1, 4, 4)], [(1, 4, 4)] * 3]
            assert forwards(engine) == 2
            assert sample(engine, "encoder_service_images_encoded_total", device="cpu") == 4
            assert sample(engine, "encoder_service_patches_encoded_total") == 4 * 16

    asyncio.run(main())


def test_batches_stay_within_max_batch_tokens(fake_model):
    async def main():
        async with running_engine(fake_model, max_batch_tokens=40) as engine:
            blocker = await hold_worker(engine, fake_model)
            task = asyncio.create_task(encode_all(engine, [patches(i, seed=10 + i) for i in range(5)]))
            await until(lambda: engine.queued_images == 5)
            fake_model.gate.set()
            await asyncio.gather(blocker, task)
            assert [len(b) for b in fake_model.batches] == [1, 2, 2, 1]  # 16 patches each, 40 per forward
            assert all(sum(t * h * w for t, h, w in b) <= 40 for b in fake_model.batches)

    asyncio.run(main())


def test_one_image_over_max_batch_tokens_is_rejected_naming_both_numbers(fake_model):
    async def main():
        async with running_engine(fake_model, max_batch_tokens=32) as engine:
            with pytest.raises(ResourceExhausted, match=r"36 patches.*--max-batch-tokens 32"):
                engine.check_grid([1, 6, 6])
            with pytest.raises(ResourceExhausted, match=r"image 1: image has 36 patches.*32") as info:
                await encode_all(engine, [encoded(0), encoded(1, (1, 6, 6))])
            assert info.value.image_index == 1
            assert fake_model.batches == [] and engine.queued_images == 0

    asyncio.run(main())


def test_a_bad_image_fails_its_request_before_anything_is_queued(fake_model):
    async def main():
        async with running_engine(fake_model) as engine:
            bad = ImageInput(2, "encoded", data=b"\x89PNG truncated")
            with pytest.raises(InvalidInput, match="image 2: not a decodable image"):
                await encode_all(engine, [patches(0, seed=1), encoded(1, seed=2), bad])
            assert fake_model.batches == [] and engine.queued_images == 0
            assert engine.lookup([]) == [] and len(engine.cache) == 0
            results = await encode_all(engine, [patches(0, seed=1), encoded(1, seed=2)])
            assert sorted(r.index for r in results) == [0, 1]

    asyncio.run(main())


def test_cache_hits_stream_first_then_images_as_they_complete(fake_model):
    async def main():
        async with running_engine(fake_model) as engine:
            await encode_all(engine, [patches(0, seed=7)])
            results = await encode_all(engine, [patches(0, seed=8), patches(1, seed=7), encoded(2, seed=9)])
            assert results[0].index == 1 and results[0].cache_hit
            assert sorted(r.index for r in results[1:]) == [0, 2]
            assert all(r.timing.forward_ms > 0 for r in results[1:])

    asyncio.run(main())


def test_an_embedding_asked_in_another_dtype_is_converted_once_and_kept_in_the_cache(fake_model):
    async def main():
        async with running_engine(fake_model) as engine:
            (miss,) = await encode_all(engine, [patches(0, seed=5)])
            model_bytes = engine.cache.used_bytes
            first = miss.wire_bytes("float16")  # a float32 model: float16 is a conversion
            assert engine.cache.used_bytes == model_bytes + miss.embedding.nbytes // 2
            (hit,) = await encode_all(engine, [patches(0, seed=5)])
            again = hit.wire_bytes("float16")
            assert hit.cache_hit and again.obj is first.obj  # the kept bytes, not a new conversion
            assert bytes(again) == miss.embedding.to(torch.float16).numpy().tobytes()
            assert hit.wire_bytes("float32").obj is not first.obj  # the model dtype: a view as before
            assert engine.cache.used_bytes == model_bytes + miss.embedding.nbytes // 2

    asyncio.run(main())


def test_without_a_cache_a_conversion_is_served_and_not_kept(fake_model):
    async def main():
        async with running_engine(fake_model, cache_bytes=0) as engine:
            (r,) = await encode_all(engine, [patches(0, seed=5)])
            assert bytes(r.wire_bytes("float16")) == r.embedding.to(torch.float16).numpy().tobytes()
            assert engine.cache.used_bytes == 0 and len(engine.cache) == 0

    asyncio.run(main())


def test_patch_dtypes_are_converted_to_float32(fake_model):
    async def main():
        async with running_engine(fake_model) as engine:
            x = fake_model.patches((1, 4, 4), 4)
            bf16_bits = (torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy()).tobytes()
            cases = {
                "float16": (x.astype("<f2").tobytes(), 2, x.astype(np.float16).astype(np.float32)),
                "bfloat16": (bf16_bits, 3, torch.from_numpy(x).to(torch.bfloat16).float().numpy()),
                "uint8": (np.arange(64, dtype=np.uint8).tobytes(), 4, np.arange(64, dtype=np.float32)),
            }
            for name, (data, enum, as_f32) in cases.items():
                image = ImageInput(0, "patches", data=data, grid=(1, 4, 4), patch_dtype=name, dtype_enum=enum)
                (r,) = await encode_all(engine, [image])
                torch.testing.assert_close(r.embedding, fake_model.reference(as_f32.reshape(-1, 4)),
                                           rtol=0, atol=0, msg=name)

    asyncio.run(main())


class _TwoPhaseFake:
    """Wraps the fake so that enqueueing a forward and waiting for it are separate, recorded steps."""

    def __init__(self, model) -> None:
        self._model = model
        self.events: list[tuple[str, int]] = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def encode_inputs_async(self, inputs):
        pending = self._model.encode_inputs_async(inputs)
        n = len(self._model.batches)  # 0 for the warm-up forwards
        self.events.append(("launch", n))

        def wait():
            self.events.append(("wait", n))
            return pending.wait()

        return SimpleNamespace(wait=wait, device_seconds=lambda: None, device_preprocess_seconds=lambda: None)


def test_next_batch_is_enqueued_before_waiting_for_the_one_in_flight(fake_model):
    # Back-to-back batches keep the device busy: the worker enqueues batch i+1 (stacking, metadata,
    # host-to-device copy) before it blocks on batch i's result.
    model = _TwoPhaseFake(fake_model)

    async def main():
        async with running_engine(model, max_batch_tokens=16) as engine:
            blocker = await hold_worker(engine, fake_model)
            images = [patches(i, seed=20 + i) for i in range(3)]
            task = asyncio.create_task(encode_all(engine, images))
            await until(lambda: len(engine._queue) == 3)  # queued for a forward, not still being prepared
            fake_model.gate.set()
            await blocker
            results = await task
            assert len(fake_model.batches) == 4  # the blocker, then one image per forward
            events = [e for e in model.events if e[1] > 0]
            for i in (1, 2, 3):
                assert events.index(("launch", i + 1)) < events.index(("wait", i)), events
            for r in results:
                expected = fake_model.reference(fake_model.patches((1, 4, 4), 20 + r.index))
                torch.testing.assert_close(r.embedding, expected, rtol=0, atol=0)

    asyncio.run(main())
