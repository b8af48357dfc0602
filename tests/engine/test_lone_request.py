"""A lone request (nothing else in flight) prepares its small image on the event loop, not in a thread
(engine/preparation.py, ALONE_INLINE_BYTES): the round trip to a thread that has been idle costs more than
a small JPEG's decode there. Checked here: where each image's CPU half runs, lone and not, within the
bounds and past each of them, and that the answers do not depend on where it ran. The loop stall those
bounds allow is checked against a real server in tests/security/test_decode_bombs.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading

import numpy as np
import pytest
import torch
from nvjpeg_stand_in import jpeg, photo
from PIL import Image
from prometheus_client import CollectorRegistry

from encoder_service.config import ServiceConfig
from encoder_service.engine import Engine, ImageInput, preparation
from encoder_service.metrics import ServiceMetrics
from encoder_service.models import load_vision_model

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def model():
    return load_vision_model("tiny-qwen2.5-vl", device="cpu", dtype=torch.float32)


@contextlib.asynccontextmanager
async def engine_where_prepared(model):
    """A started engine whose CPU halves note the thread they ran on (``threads``, in order)."""
    engine = Engine(ServiceConfig(batch_wait_ms=0.0), model, metrics=ServiceMetrics(CollectorRegistry()))
    threads: list[str] = []
    prepare = engine._prepare_sync

    def noted(image, expensive_pixels):
        threads.append(threading.current_thread().name)
        return prepare(image, expensive_pixels)

    engine._prepare_sync = noted
    await engine.start()
    try:
        yield engine, threads
    finally:
        await engine.stop()


def encoded(index: int, data: bytes) -> ImageInput:
    return ImageInput(index=index, kind="encoded", data=data)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


async def embeddings(engine, images) -> dict[int, np.ndarray]:
    return {r.index: r.embedding.numpy().copy() async for r in engine.encode(images)}


def test_a_lone_small_jpeg_is_decoded_on_the_event_loop_and_gives_the_same_embedding(model):
    data = jpeg(photo(120, 90, seed=1))

    async def run():
        async with engine_where_prepared(model) as (engine, threads):
            lone = await embeddings(engine, [encoded(0, data)])
            assert threads == [threading.current_thread().name]  # the loop's thread
        async with engine_where_prepared(model) as (engine, threads):
            # The same image beside another: both jobs are in flight, so both decode in the threads.
            pair = await embeddings(engine, [encoded(0, data), encoded(1, jpeg(photo(120, 90, seed=2)))])
            assert len(threads) == 2 and all(name.startswith("preprocess") for name in threads)
        np.testing.assert_array_equal(lone[0], pair[0])

    asyncio.run(run())


def test_a_lone_image_past_any_bound_is_decoded_in_a_thread(model, monkeypatch):
    small = jpeg(photo(120, 90, seed=3))

    async def where(data: bytes) -> list[str]:
        async with engine_where_prepared(model) as (engine, threads):
            await embeddings(engine, [encoded(0, data)])
            return threads

    # Not a JPEG: other decoders are slower a pixel and less bounded by their headers.
    assert [name[:10] for name in asyncio.run(where(png(photo(120, 90, seed=3))))] == ["preprocess"]
    # More bytes than the bound.
    monkeypatch.setattr(preparation, "ALONE_INLINE_BYTES", len(small) - 1)
    assert [name[:10] for name in asyncio.run(where(small))] == ["preprocess"]
    monkeypatch.undo()
    # More pixels than the bound, by the header: answered EXPENSIVE on the loop before any pixel is
    # decoded, then decoded in the ordinary pool.
    monkeypatch.setattr(preparation, "ALONE_MAX_PIXELS", 120 * 90 - 1)
    loop_thread = threading.current_thread().name
    assert asyncio.run(where(small)) == [loop_thread, "preprocess_0"]


def with_segment(data: bytes, marker: int, payload: bytes) -> bytes:
    """``data`` (a JPEG) with one more segment right after SOI."""
    return data[:2] + bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload + data[2:]


def test_a_lone_jpeg_whose_header_is_costly_to_read_is_decoded_in_a_thread(model):
    """Pillow reads a JPEG's header in Python (a read per fill byte, a call per segment) and parses its
    EXIF, before any pixel or scan bound applies: only short, plain headers are read on the loop."""
    from encoder_service.benchmarks.reliability.fuzz_inputs import jpeg_scan_bomb

    small = jpeg(photo(120, 90, seed=6))
    loop_thread = threading.current_thread().name

    async def where(data: bytes) -> list[str]:
        async with engine_where_prepared(model) as (engine, threads):
            await embeddings(engine, [encoded(0, data)])
            return threads

    assert asyncio.run(where(small)) == [loop_thread]
    costly = {
        "a fill byte before a marker": small[:2] + b"\xff" + small[2:],
        "a header over ALONE_HEADER_BYTES": with_segment(small, 0xFE, b"x" * preparation.ALONE_HEADER_BYTES),
        "more segments than ALONE_HEADER_SEGMENTS": small[:2] + b"\xff\xfe\x00\x02" * 40 + small[2:],
        # More FF DA pairs than ORDINARY_JPEG_SCANS (inside a comment): counting its scans walks its markers.
        "17 FF DA pairs in a comment": with_segment(jpeg(photo(120, 90, seed=7), progressive=True), 0xFE,
                                                    b"\xff\xda" * 17),
    }
    for name, data in costly.items():
        assert [thread[:10] for thread in asyncio.run(where(data))] == ["preprocess"], name
    # Few pixels but more scans than encoders write: the expensive pool, never the loop.
    assert asyncio.run(where(jpeg_scan_bomb(96, 80))) == ["preprocess_0", "preprocess-expensive_0"]


def test_a_bad_lone_jpeg_is_refused_with_the_reason_as_from_a_thread(model):
    from encoder_service.errors import InvalidInput

    data = jpeg(photo(120, 90, seed=4))
    truncated = data[:len(data) // 2]  # in its scan data: the header is whole

    async def run():
        async with engine_where_prepared(model) as (engine, threads):
            with pytest.raises(InvalidInput, match=r"not a decodable image|truncated"):
                await embeddings(engine, [encoded(0, truncated)])
            assert threads == [threading.current_thread().name]
            # The engine serves on: the next lone image is encoded.
            assert len(await embeddings(engine, [encoded(0, jpeg(photo(120, 90, seed=5)))])) == 1

    asyncio.run(run())


def test_a_lone_request_of_patches_is_checked_on_the_event_loop(model):
    grid = (1, 4, 4)
    data = np.random.default_rng(0).standard_normal((16, model.spec.patch_dim)).astype(np.float32).tobytes()

    async def run():
        async with engine_where_prepared(model) as (engine, threads):
            image = ImageInput(index=0, kind="patches", data=data, grid=grid, patch_dtype="float32", dtype_enum=1)
            assert len(await embeddings(engine, [image])) == 1
            assert threads == [threading.current_thread().name]

    asyncio.run(run())
