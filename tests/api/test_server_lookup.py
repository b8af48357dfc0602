"""Lookup: the cached flags in the caller's order, at most MAX_LOOKUP_HASHES per call, and a big one
never holds the event loop (the one thread that answers every call, health checks included) for
its whole length: it answers in slices and lets the loop run between them."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from encoder_client import EncoderClient
from encoder_client.protocol import encoder_pb2, encoder_pb2_grpc
from engine_helpers import encode_all, patches, running_engine
from prometheus_client import CollectorRegistry

from encoder_service.api.service_interceptor import CallBook
from encoder_service.api.servicer import LOOKUP_SLICE, MAX_LOOKUP_HASHES, VisionEncoderServicer
from encoder_service.config import ServiceConfig
from encoder_service.metrics import ServiceMetrics

pytestmark = pytest.mark.timeout(120)


def other_hashes(n: int) -> list[str]:
    return [f"{i:064x}" for i in range(n)]  # no image hashes to these


def test_a_big_lookup_lets_the_event_loop_run_between_its_slices(fake_model):
    """Counted in loop turns, not in time: a ticker task that runs once per turn of the loop must
    run many times while a Lookup of MAX_LOOKUP_HASHES hashes is answered; a Lookup answered in
    one go leaves it no turn at all."""

    async def main():
        async with running_engine(fake_model) as engine:
            results = await encode_all(engine, [patches(0, seed=1), patches(1, seed=2)])
            cached = {r.content_hash for r in results}
            hashes = other_hashes(MAX_LOOKUP_HASHES)
            where = (0, LOOKUP_SLICE - 1, LOOKUP_SLICE, MAX_LOOKUP_HASHES - 1)  # both sides of a slice edge
            for position, content_hash in zip(where, [*cached, *cached], strict=True):
                hashes[position] = content_hash
            config = ServiceConfig()
            servicer = VisionEncoderServicer(config.requests, config.security, ServiceMetrics(CollectorRegistry()),
                                             CallBook(), shared_memory=config.shared_memory == "on")
            servicer.engine = engine
            turns = 0
            stop = False

            async def ticker():
                nonlocal turns
                while not stop:
                    turns += 1
                    await asyncio.sleep(0)

            task = asyncio.create_task(ticker())
            await asyncio.sleep(0)  # the ticker is running
            before = turns
            response = await servicer.Lookup(encoder_pb2.LookupRequest(content_hashes=hashes), None)
            during = turns - before
            stop = True
            await task
            assert [i for i, hit in enumerate(response.cached) if hit] == list(where)
            assert len(response.cached) == MAX_LOOKUP_HASHES
            slices = MAX_LOOKUP_HASHES // LOOKUP_SLICE
            assert during >= slices - 1, f"the loop ran {during} times during a Lookup of {slices} slices"

    asyncio.run(main())


def test_lookup_over_a_real_server_answers_in_order_and_refuses_over_the_cap(encoder_server):
    rng = np.random.default_rng(5)
    images = [(rng.standard_normal((64, 1176), dtype=np.float32), (1, 8, 8)) for _ in range(2)]
    with EncoderClient(encoder_server.target) as client:
        known = [r.content_hash for r in client.encode(images)]
        hashes = other_hashes(MAX_LOOKUP_HASHES)
        hashes[LOOKUP_SLICE], hashes[-1] = known
        cached = client.lookup(hashes)
    assert [i for i, hit in enumerate(cached) if hit] == [LOOKUP_SLICE, MAX_LOOKUP_HASHES - 1]
    with grpc.insecure_channel(encoder_server.target) as channel, pytest.raises(grpc.RpcError) as exc:
        encoder_pb2_grpc.VisionEncoderStub(channel).Lookup(
            encoder_pb2.LookupRequest(content_hashes=other_hashes(MAX_LOOKUP_HASHES + 1)), timeout=30)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"at most {MAX_LOOKUP_HASHES}" in exc.value.details()
