"""``--decode nvjpeg`` with ``--devices`` without a GPU: the JPEG's bytes cross the shared-memory
hand-off and the worker process decodes them with the Pillow stand-in (tests/engine/nvjpeg_stand_in.py)
that its engine's ``worker_setup`` installs there. The real nvJPEG behind a real ``--devices 0``
server is a ``gpu`` test (tests/gpu/test_gpu_nvjpeg.py)."""

from __future__ import annotations

import asyncio
import functools
import io

import numpy as np
import pytest
import torch
from nvjpeg_stand_in import PillowStandIn, forward_figures, jpeg, models, photo
from prometheus_client import CollectorRegistry

from encoder_service.config import ServiceConfig
from encoder_service.config_flags import parse_serve_args
from encoder_service.engine import Engine, ImageInput
from encoder_service.engine.handoff import copy_bytes, describe, rebuild
from encoder_service.engine.shared_buffer import SharedBuffer
from encoder_service.errors import InvalidInput
from encoder_service.metrics import ServiceMetrics
from encoder_service.preprocess import nvjpeg

pytestmark = pytest.mark.timeout(240)

GOOD = (jpeg(photo(150, 70, seed=1), 6), jpeg(photo(80, 120, seed=2)))
# Valid files the stand-in refuses, as nvJPEG refuses corrupt data.
BAD = (jpeg(photo(90, 60, seed=9)), jpeg(photo(90, 60, seed=10)))


class BoomStandIn(PillowStandIn):
    """The stand-in, also failing a whole batch (not one image) on the files in ``boom``."""

    def __init__(self, bad: tuple[bytes, ...], boom: tuple[bytes, ...]) -> None:
        super().__init__(bad)
        self.boom = set(boom)

    def __call__(self, files, device):
        if any(file.numpy().tobytes() in self.boom for file in (files if isinstance(files, list) else [files])):
            raise ValueError("boom: the whole batch fails")
        return super().__call__(files, device)


def install_stand_in(bad: tuple[bytes, ...] = (), boom: tuple[bytes, ...] = ()) -> None:
    """Runs in the worker process (``Engine(worker_setup=...)``), before its model loads: what the
    ``stand_in`` fixture of tests/engine/test_nvjpeg_decode.py does to this process."""
    nvjpeg.device_decode = BoomStandIn(bad, boom)
    nvjpeg.check_available = lambda device: None


def png() -> bytes:
    buffer = io.BytesIO()
    photo(64, 50, seed=3).save(buffer, "PNG")
    return buffer.getvalue()


# --- the hand-off ----------------------------------------------------------------------------------
@pytest.mark.usefixtures("stand_in")
def test_a_jpeg_crosses_the_hand_off_as_its_bytes_and_is_read_in_place_by_the_worker():
    _, gpu = models()
    item = gpu.decode(GOOD[0])
    assert isinstance(item, nvjpeg.JpegImage)
    buffer = SharedBuffer.create(128 + item.nbytes)
    try:
        copy_bytes(buffer.view(128, item.nbytes), item.host_bytes())
        rebuilt = rebuild(buffer, describe(128, item))
        assert isinstance(rebuilt, nvjpeg.JpegImage) and bytes(rebuilt.data) == item.data
        assert (rebuilt.orientation, rebuilt.size, rebuilt.resize_to, rebuilt.pad_to, rebuilt.grid) \
            == (item.orientation, item.size, item.resize_to, item.pad_to, item.grid)
        # A view of the shared buffer, not a copy; the device decoder reads it in place too.
        assert isinstance(rebuilt.data, memoryview) and not rebuilt.data.readonly
        assert nvjpeg._host_file(rebuilt.data).data_ptr() == buffer.view(128, 1).ctypes.data
        (want,), (got,) = nvjpeg.decode_on_device([item], "cpu"), nvjpeg.decode_on_device([rebuilt], "cpu")
        assert torch.equal(got, want)
        del rebuilt, got
    finally:
        buffer.close()


def test_nvjpeg_with_devices_is_accepted_at_start_up():
    config = parse_serve_args(["--decode", "nvjpeg", "--devices", "0,1"], environ={})
    assert (config.decode, config.devices) == ("nvjpeg", "0,1")


# --- worker processes with the stand-in ------------------------------------------------------------
def run_engine(config: ServiceConfig, batches: list[list[bytes]], bad: tuple[bytes, ...] = (),
               boom: tuple[bytes, ...] = (), metrics: ServiceMetrics | None = None):
    """Each batch's images encoded as concurrent one-image requests (a long batch wait puts them in
    one forward); returns (the engine's description, each batch's results or errors)."""
    async def main():
        engine = Engine(config, metrics=metrics or ServiceMetrics(CollectorRegistry()),
                        worker_setup=functools.partial(install_stand_in, bad, boom))
        await engine.start()
        try:
            async def encode(data):
                (result,) = [r async for r in engine.encode([ImageInput(index=0, kind="encoded", data=data)])]
                return result
            results = [await asyncio.gather(*map(encode, batch), return_exceptions=True) for batch in batches]
            return engine.describe(), results
        finally:
            await engine.stop()

    return asyncio.run(main())


def devices_config(devices: str, **settings) -> ServiceConfig:
    return ServiceConfig(devices=devices, decode="nvjpeg", preprocess="torch", batch_wait_ms=300.0, **settings)


def in_process_embedding(model, data: bytes) -> torch.Tensor:
    """What the in-process nvjpeg path (the stand-in in this process) computes for one image."""
    item = model.decode(data)
    with torch.inference_mode():
        return model.encode_packed(model.pixel_values([item]), [item.grid])[0]


@pytest.mark.usefixtures("stand_in")
def test_worker_processes_decode_jpegs_as_the_in_process_nvjpeg_path_does():
    _, gpu = models()
    images = [*GOOD, png()]
    description, (results,) = run_engine(devices_config("cpu,cpu"), [images])
    assert description.decode == "nvjpeg" and description.cache_namespace == gpu.cache_namespace
    assert description.device == "cpu:0,cpu:1"
    for data, result in zip(images, results):
        assert not isinstance(result, BaseException), result
        got, want = result.embedding.float().numpy(), in_process_embedding(gpu, data).numpy()
        # float32 on CPU in other processes, batches and thread counts: equal up to summation order.
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


@pytest.mark.usefixtures("stand_in")
def test_an_undecodable_jpeg_fails_alone_in_a_worker_process_and_its_batch_mates_are_encoded():
    _, gpu = models()
    # The bad file beside a good one; then a batch of nothing but bad files (no forward at all);
    # then the worker still serves.
    batches = [[GOOD[1], BAD[0]], list(BAD), [GOOD[0]]]
    metrics = ServiceMetrics(CollectorRegistry())
    _, (mixed, only_bad, after) = run_engine(devices_config("cpu"), batches, bad=BAD, metrics=metrics)
    ok, failed = mixed
    assert isinstance(failed, InvalidInput) and "could not be decoded on the device" in str(failed)
    np.testing.assert_allclose(ok.embedding.float().numpy(), in_process_embedding(gpu, GOOD[1]).numpy(),
                               rtol=1e-5, atol=1e-6)
    assert all(isinstance(r, InvalidInput) for r in only_bad)
    np.testing.assert_allclose(after[0].embedding.float().numpy(), in_process_embedding(gpu, GOOD[0]).numpy(),
                               rtol=1e-5, atol=1e-6)
    # Two forwards of one image each, however the mixed pair was batched: the bad files ran none.
    assert forward_figures(metrics) == {"batches": 2, "images": 2}


@pytest.mark.usefixtures("stand_in")
def test_a_batch_failing_at_launch_behind_one_in_flight_is_answered_in_its_turn():
    # 48 and 24 patches do not fit one forward of 64: the front end sends the good image's batch,
    # then at once the other's, which the worker takes while the first is still running. Its launch
    # error must wait for the first batch's answer: sent ahead of it, the front end would take the
    # worker for dead and fail the good image too (UNAVAILABLE).
    _, gpu = models()
    good, boom = GOOD[1], BAD[0]
    assert [gpu.num_patches(gpu.decode(f).grid) for f in (good, boom)] == [48, 24]
    _, ((ok, failed),) = run_engine(devices_config("cpu", max_batch_tokens=64), [[good, boom]], boom=(boom,))
    assert isinstance(failed, ValueError) and "boom" in str(failed)
    assert not isinstance(ok, BaseException), ok
    np.testing.assert_allclose(ok.embedding.float().numpy(), in_process_embedding(gpu, good).numpy(),
                               rtol=1e-5, atol=1e-6)
