"""The in-process engine around a fake model (tests/conftest.py's ``fake_model``), as the engine tests
drive it (tests/engine/, and the API's and the decode limits' tests that need an engine without a server):
start one, feed it images, read its metrics, hold its worker inside a forward, wait for a condition."""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import CollectorRegistry

from encoder_service.config import ServiceConfig
from encoder_service.engine import Engine, ImageInput
from encoder_service.metrics import ServiceMetrics


@contextlib.asynccontextmanager
async def running_engine(model, **overrides):
    """An engine recording into a registry of its own: its counts are this test's alone."""
    engine = Engine(ServiceConfig(**{"batch_wait_ms": 0.0, **overrides}), model,
                    metrics=ServiceMetrics(CollectorRegistry()))
    await engine.start()
    try:
        yield engine
    finally:
        model.gate.set()
        await engine.stop()


def sample(engine, name: str, **labels: str) -> float:
    """One series of the engine's registry (0 before it exists): what /metrics would show."""
    return engine.metrics.registry.get_sample_value(name, labels) or 0.0


def forwards(engine) -> float:
    return sample(engine, "encoder_service_forward_batches_total", device="cpu")


def joins(engine) -> float:
    return sample(engine, "encoder_service_inflight_joins_total")


def patches(index: int, grid=(1, 4, 4), seed: int = 0) -> ImageInput:
    from fake_model import FakeVisionModel

    data = FakeVisionModel.patches(grid, seed).tobytes()
    return ImageInput(index=index, kind="patches", data=data, grid=grid, patch_dtype="float32", dtype_enum=1)


def encoded(index: int, grid=(1, 4, 4), seed: int = 0) -> ImageInput:
    return ImageInput(index=index, kind="encoded", data=f"img:{','.join(map(str, grid))}:{seed}".encode())


async def encode_all(engine, images):
    return [r async for r in engine.encode(images)]


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.002)


async def hold_worker(engine, model, seed: int = 999) -> asyncio.Task:
    """Starts a request whose forward blocks on model.gate; returns once the worker is inside it."""
    model.gate.clear()
    model.entered.clear()
    task = asyncio.create_task(encode_all(engine, [patches(0, seed=seed)]))
    assert await asyncio.to_thread(model.entered.wait, 5)
    return task
