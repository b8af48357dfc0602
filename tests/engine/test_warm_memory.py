"""The warm copies the cache keeps (engine/warm_memory.py): equal to a clone, owned, bounded."""

from __future__ import annotations

import torch

from encoder_service.engine.warm_memory import WarmBuffers


def _rows(tokens: int, width: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_a_copy_equals_its_source_and_owns_exactly_its_bytes():
    pool = WarmBuffers()
    packed = _rows(12)
    first = pool.copies(list(packed.split([5, 7])))
    pool.drain()
    second = pool.copies(list(packed.split([5, 7])))  # from the buffers the thread prepared
    assert pool.hits == 2 and pool.misses == 2
    for copies in (first, second):
        assert [c.shape for c in copies] == [(5, 64), (7, 64)]
        assert torch.equal(torch.cat(copies), packed)
        for copy in copies:
            # Its own storage of exactly its size: the source (a batch's output) may be reused at once.
            assert copy.untyped_storage().nbytes() == copy.nbytes
            assert copy.untyped_storage().data_ptr() != packed.untyped_storage().data_ptr()
    packed.zero_()
    assert not torch.equal(second[0], packed[:5])


def test_a_buffer_is_never_handed_out_twice():
    pool = WarmBuffers(per_size=2)
    seen = set()
    kept = []  # alive, so that a freed address cannot come back from the allocator
    for round_ in range(5):
        copies = pool.copies([_rows(8, seed=round_), _rows(8, seed=round_ + 10)])
        pool.drain()
        for copy in copies:
            address = copy.untyped_storage().data_ptr()
            assert address not in seen
            seen.add(address)
        kept.extend(copies)
        assert torch.equal(copies[0], _rows(8, seed=round_))
    assert pool.hits >= 6


def test_the_pool_stays_within_its_bytes_and_drops_the_sizes_not_asked_for_lately():
    row = _rows(1).nbytes
    pool = WarmBuffers(max_bytes=40 * row, per_size=4)
    for tokens in (4, 5, 6, 7):  # 4 x (4 + 5 + 6 + 7) rows would be 88 rows: over the bound
        for _ in range(2):  # batches of four of one size
            pool.copies([_rows(tokens)] * 4)
            pool.drain()
            assert pool.held_bytes <= pool.max_bytes
    sizes = {size: len(buffers) for size, buffers in pool._free.items()}
    assert sizes[7 * row] == 4  # the latest size is served in full
    assert sizes.get(4 * row, 0) < 4  # the oldest gave way
    assert pool.held_bytes == sum(size * count for size, count in sizes.items())


def test_the_thread_prepares_no_more_than_the_copies_it_replaces():
    # A caller who makes the server produce a new size each time costs the thread one buffer a copy:
    # the page faults that copy would have taken itself, never per_size of them.
    pool = WarmBuffers(per_size=4)
    for tokens in range(1, 11):
        pool.copies([_rows(tokens)])
        pool.drain()
    assert pool.prepared == 10 and pool.hits == 0
    pool.copies([_rows(10)] * 3)  # a batch of three of one size: three replaced
    pool.drain()
    assert pool.hits == 1 and pool.prepared == 13


def test_sizes_over_half_the_bound_and_odd_tensors_are_plain_clones():
    pool = WarmBuffers(max_bytes=1 << 20)
    big = torch.zeros(1 << 20, dtype=torch.uint8)
    strided = _rows(16)[::2]
    for _ in range(2):
        copies = pool.copies([big, strided])
        pool.drain()
        assert torch.equal(copies[0], big) and torch.equal(copies[1], strided)
    assert pool.hits == 0 and pool.held_bytes == 0


def test_the_idle_trim_keeps_only_the_size_asked_for_last():
    pool = WarmBuffers(per_size=2)
    for tokens in (3, 5, 7):
        pool.copies([_rows(tokens)] * 2)
        pool.drain()
    pool.trim()
    assert {size: len(buffers) for size, buffers in pool._free.items()} == {_rows(7).nbytes: 2}
    assert pool.held_bytes == 2 * _rows(7).nbytes
    copy = pool.copies([_rows(7, seed=3)])[0]  # still served warm
    assert pool.hits == 1 and torch.equal(copy, _rows(7, seed=3))


def test_a_buffer_that_cannot_be_made_gives_its_room_back(monkeypatch):
    pool = WarmBuffers(per_size=2)
    real_empty = torch.empty

    def failing_empty(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(torch, "empty", failing_empty)
    pool.copies([_rows(4)] * 2)
    pool.drain()
    assert pool.held_bytes == 0 and pool._filling == {} and pool.prepared == 0
    monkeypatch.setattr(torch, "empty", real_empty)
    pool.copies([_rows(4)])
    pool.drain()
    assert pool.held_bytes == _rows(4).nbytes and pool.prepared == 1  # the pool works again


def test_a_buffer_taken_for_a_decode_is_replaced_for_the_next_one_of_its_size():
    pool = WarmBuffers(max_bytes=1 << 20)
    assert pool.take(3000) is None  # nothing ready yet: the caller uses new memory; one is ordered
    pool.drain()
    array = pool.take_array(3000)
    assert array is not None and array.nbytes == 3000 and array.flags.writeable
    pool.drain()
    assert pool.take(3000) is not None  # the one taken was replaced
    assert pool.take(600 << 10) is None and pool.take(0) is None  # over half the bound, or nothing: none
    pool.drain()
    assert pool.take(600 << 10) is None and pool.held_bytes <= pool.max_bytes


def test_the_engine_decodes_a_plain_jpeg_into_memory_already_mapped(monkeypatch):
    # The second JPEG of a size lands in a buffer the decode buffers' thread touched after the first, and
    # its embedding is the one a decode into new memory gives.
    import asyncio
    import io

    import numpy as np
    from PIL import Image
    from prometheus_client import CollectorRegistry

    from encoder_service.benchmarks.service_clients import photo_pixels
    from encoder_service.config import ServiceConfig
    from encoder_service.engine import Engine, ImageInput
    from encoder_service.engine.warm_memory import DECODE_BUFFERS
    from encoder_service.metrics import ServiceMetrics

    def jpeg(seed: int) -> bytes:
        out = io.BytesIO()
        Image.fromarray(photo_pixels(seed, 112, 84)).save(out, "JPEG", quality=90)
        return out.getvalue()

    async def encode_each(images: list[bytes]) -> list:
        # torch preprocessing (a GPU's default): the decoded pixels are what the CPU hands over.
        engine = Engine(ServiceConfig(model="tiny-qwen2.5-vl", device="cpu", preprocess="torch"),
                        metrics=ServiceMetrics(CollectorRegistry()))
        await engine.start()
        try:
            out = []
            for data in images:
                (result,) = [r async for r in engine.encode([ImageInput(index=0, kind="encoded", data=data)])]
                out.append(result.embedding.clone())
                DECODE_BUFFERS.drain()
            return out
        finally:
            await engine.stop()

    images = [jpeg(1), jpeg(2)]
    hits = DECODE_BUFFERS.hits
    warm = asyncio.run(encode_each(images))
    assert DECODE_BUFFERS.hits > hits
    monkeypatch.setattr(DECODE_BUFFERS, "take_array", lambda nbytes: None)  # every decode into new memory
    cold = asyncio.run(encode_each(images))
    assert not np.array_equal(warm[0], warm[1])
    assert all(np.array_equal(w, c) for w, c in zip(warm, cold))
