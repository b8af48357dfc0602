"""``--devices``: what an operator may write, and the clear error for everything else."""

from __future__ import annotations

import pytest

from encoder_service.config_flags import parse_serve_args
from encoder_service.engine.devices import WorkerDevice, parse_devices


def test_gpu_indices_become_one_worker_each_seeing_only_its_own_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert parse_devices("0,cuda:1") == [WorkerDevice("cuda:0", "cuda:0", "0"), WorkerDevice("cuda:1", "cuda:0", "1")]


def test_gpu_indices_count_the_gpus_this_process_may_see(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert [d.visible for d in parse_devices("0,1")] == ["4", "6"]
    with pytest.raises(ValueError, match=r"GPU 2.*shows 2 GPU"):
        parse_devices("2")


def test_cpu_workers_are_told_apart_by_their_place():
    assert [d.label for d in parse_devices("cpu,cpu")] == ["cpu:0", "cpu:1"]
    assert all(d.visible is None and d.device == "cpu" for d in parse_devices("cpu,cpu"))


@pytest.mark.parametrize(("devices", "message"), [
    ("0,0", "names a GPU twice"),
    ("0,cpu", "mixes cpu and GPU workers"),
    ("gpu0", "'gpu0' is neither cpu nor a GPU index"),
    ("cuda:x", "'cuda:x' is neither cpu nor a GPU index"),
])
def test_bad_devices_are_refused_at_start_up_naming_what_is_wrong(devices, message):
    with pytest.raises(ValueError, match=message):
        parse_serve_args(["--devices", devices])


def test_devices_set_the_device_kind_and_scale_the_decode_threads_with_the_gpus(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    one = parse_serve_args(["--devices", "0"])
    two = parse_serve_args(["--devices", "0,1"])
    assert (one.device, two.device) == ("cuda", "cuda")
    assert (one.preprocess_threads, two.preprocess_threads) == (8, 16)
    assert parse_serve_args(["--devices", "cpu,cpu"]).device == "cpu"
    assert parse_serve_args([]).devices == ""  # default: one in-process worker on --device


def test_a_front_end_with_worker_processes_copies_with_one_torch_thread_and_restores_it():
    # Its torch work is copies in and out of the hand-off buffers; a pool of OpenMP threads there
    # spin-waited through the cores the decode threads need (bench/RESULTS.md, 2026-11-23, commit 69d7da2).
    import asyncio

    import torch
    from prometheus_client import CollectorRegistry

    from encoder_service.config import ServiceConfig
    from encoder_service.engine import Engine
    from encoder_service.metrics import ServiceMetrics

    async def main():
        engine = Engine(ServiceConfig(devices="cpu", model="tiny-qwen2.5-vl"),
                        metrics=ServiceMetrics(CollectorRegistry()))
        await engine.start()
        try:
            return torch.get_num_threads()
        finally:
            await engine.stop()

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert asyncio.run(main()) == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
