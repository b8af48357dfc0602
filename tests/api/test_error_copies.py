"""Typed errors on their way from where they are raised to the caller's status: a job's error is
shared by every request waiting for it, so each request gets a copy naming its own image, and that
copy keeps the error's type and its retry hint; a timeout is told apart by its type; the error kept
on a shared job holds no frames (and so none of the pixels their locals hold)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import grpc
import numpy as np
import pytest
from encoder_client.protocol import encoder_pb2 as pb
from encoder_client.protocol import encoder_pb2_grpc

from encoder_service.api.error_status import trailers
from encoder_service.api.sink_push import SinkFailed
from encoder_service.benchmarks.reliability.fuzz_inputs import jpeg_scan_bomb, png_chunk_bomb
from encoder_service.engine.jobs import detached, retag
from encoder_service.errors import RETRY_AFTER_S, DecodeTimeout, EncoderError, InvalidInput, ResourceExhausted
from encoder_service.preprocess.decode import decode_budget, decode_image

pytestmark = pytest.mark.timeout(120)


# --- copies keep the type and the retry hint ------------------------------------------------------------


def test_a_retagged_refusal_keeps_its_type_and_retry_hint():
    shared = ResourceExhausted("expensive-decode pool full; retry later", retry_after_s=RETRY_AFTER_S)
    mine = retag(shared, 3)
    assert type(mine) is ResourceExhausted and mine is not shared
    assert mine.retry_after_s == RETRY_AFTER_S and mine.image_index == 3
    assert str(mine) == "image 3: expensive-decode pool full; retry later"
    assert trailers(mine) == (("grpc-retry-pushback-ms", "1000"),)
    assert shared.image_index is None  # the job's own error is left as it was for other requests
    assert retag(shared, 5).image_index == 5 and mine.image_index == 3
    # A refusal of the request itself keeps "never retry".
    assert retag(ResourceExhausted("too many patches"), 0).retry_after_s is None


def test_a_retagged_subclass_keeps_its_type_even_with_another_constructor():
    class Refused(ResourceExhausted):
        def __init__(self, reason: str, detail: str) -> None:
            super().__init__(detail, retry_after_s=2.5)
            self.reason = reason

    for error in (Refused("busy", "pool full"), SinkFailed("deadline", "too slow"), InvalidInput("bad grid"),
                  DecodeTimeout("decoding took more than 1 s, over --max-decode-seconds 1")):
        copy = retag(error, 7)
        assert type(copy) is type(error) and copy.image_index == 7
        assert copy.message == error.message and copy.code == error.code
        assert {k: v for k, v in vars(copy).items() if k != "image_index"} == \
               {k: v for k, v in vars(error).items() if k != "image_index"}
    assert retag(Refused("busy", "pool full"), 1).retry_after_s == 2.5


def test_for_image_drops_the_frames_of_the_original_and_with_image_still_tags_in_place():
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise ResourceExhausted("outer", retry_after_s=1.0) from inner
    except ResourceExhausted as e:
        original = e
    copy = original.for_image(2)
    assert original.__traceback__ is not None and original.__cause__ is not None
    assert copy.__traceback__ is None and copy.__cause__ is None and copy.__context__ is None
    assert copy.retry_after_s == 1.0 and copy.image_index == 2 and original.image_index is None
    tagged = EncoderError("x")
    assert tagged.with_image(4) is tagged and tagged.image_index == 4
    assert tagged.with_image(5).image_index == 4  # with_image never renames an image


def test_non_typed_errors_pass_retag_unchanged():
    error = RuntimeError("bug")
    assert retag(error, 1) is error


# --- a timeout is a type ----------------------------------------------------------------------------------


def test_the_decode_time_bound_raises_decode_timeout():
    assert issubclass(DecodeTimeout, ResourceExhausted)
    assert DecodeTimeout("x").code == "RESOURCE_EXHAUSTED"
    # Pillow parses each PNG chunk in Python: 20,000 of them take well over a millisecond.
    with decode_budget(0.001), pytest.raises(DecodeTimeout, match=r"--max-decode-seconds 0.001"):
        decode_image(png_chunk_bomb(20_000), None)
    # Other limits are not timeouts.
    with pytest.raises(ResourceExhausted) as info:
        decode_image(jpeg_scan_bomb(64, 500), None)
    assert not isinstance(info.value, DecodeTimeout)


# --- what a shared job keeps ------------------------------------------------------------------------------


def test_a_detached_error_holds_no_frames_so_the_pixels_they_held_are_freed_at_once():
    freed: list[weakref.ref] = []

    def decode_holding_pixels():
        pixels = np.zeros(16 << 20, dtype=np.uint8)  # what a decode's frame holds when it is refused
        freed.append(weakref.ref(pixels))
        raise ResourceExhausted("over a limit", retry_after_s=1.0)

    async def main():
        job = asyncio.get_running_loop().create_future()
        try:
            decode_holding_pixels()
        except ResourceExhausted as e:
            job.set_exception(detached(e))
        return job

    gc.disable()
    try:
        job = asyncio.run(main())
        assert freed[0]() is None, "the pixels are still held by the error's traceback"
        kept = job.exception()
        assert kept.__traceback__ is None and kept.__context__ is None and kept.__cause__ is None
        assert isinstance(kept, ResourceExhausted) and kept.retry_after_s == 1.0
    finally:
        gc.enable()


def test_without_detaching_the_pixels_would_stay_until_the_error_goes():
    """The check above means something: the same error kept with its traceback holds the pixels."""
    freed: list[weakref.ref] = []

    def decode_holding_pixels():
        pixels = np.zeros(1 << 20, dtype=np.uint8)
        freed.append(weakref.ref(pixels))
        raise ResourceExhausted("over a limit")

    gc.disable()
    try:
        try:
            decode_holding_pixels()
        except ResourceExhausted as e:
            kept = e
        assert freed[0]() is not None
        detached(kept)
        assert freed[0]() is None
    finally:
        gc.enable()


def test_a_memory_error_becomes_resource_exhausted_without_a_retry_hint():
    try:
        raise MemoryError()
    except MemoryError as e:
        kept = detached(e)
    assert isinstance(kept, ResourceExhausted) and kept.code == "RESOURCE_EXHAUSTED"
    assert "more memory than the server could allocate" in kept.message
    assert kept.retry_after_s is None and kept.__traceback__ is None
    assert trailers(kept) == (("grpc-retry-pushback-ms", "-1"),)


def test_other_errors_are_detached_as_themselves():
    try:
        raise RuntimeError("a bug")
    except RuntimeError as e:
        original = e
    kept = detached(original)
    assert kept is original and kept.__traceback__ is None
    # The frames are gone, not where the bug was: the log still shows it.
    assert any("raise RuntimeError" in note for note in getattr(kept, "__notes__", []))


# --- end to end: a real server's momentary refusal keeps its pushback ---------------------------------------


@pytest.fixture(scope="module")
def server(start_encoder_server):
    # Two decode threads: one thread for expensive images, with room for 4 of them at once.
    server = start_encoder_server("--preprocess-threads", "2")
    yield server
    server.stop()


def test_a_full_expensive_decode_pool_refusal_reaches_the_caller_with_its_pushback(server):
    """Ten different progressive JPEGs of 86-95 scans (allowed, but expensive: decoded in the pool of
    their own, ~0.2 s each here) in one request: four fit, the rest are refused with "retry later",
    and the request fails with the first of those, whose pushback must say when to retry, not -1."""
    images = [pb.Image(encoded=jpeg_scan_bomb(1536, 80 + i)) for i in range(10)]
    with grpc.insecure_channel(server.target) as channel:
        stub = encoder_pb2_grpc.VisionEncoderStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Encode(pb.EncodeRequest(images=images), timeout=60))
    error = info.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert "retry later" in error.details() and error.details().startswith("image "), error.details()
    pushback = dict(error.trailing_metadata())["grpc-retry-pushback-ms"]
    assert int(pushback) >= 0, f"pushback {pushback}: the retry hint was lost on the way"
    assert int(pushback) == round(RETRY_AFTER_S * 1000)
