"""The liveness watchdog (engine/watchdog.py): a device with work and no completed forward for longer
than --watchdog-timeout-s, or whose worker thread died, is stalled and the engine stops serving;
its next forward makes it serve again. The rule on a fake clock, then a real in-process engine."""

from __future__ import annotations

import asyncio

import pytest
from engine_helpers import encode_all, hold_worker, patches, running_engine, sample, until
from prometheus_client import CollectorRegistry

from encoder_service.engine.watchdog import DEAD, DOWN, UP, Watchdog
from encoder_service.metrics import ServiceMetrics

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watchdog(timeout_s: float = 10.0, batch_wait_s: float = 0.0) -> tuple[Watchdog, Clock, ServiceMetrics]:
    metrics, clock = ServiceMetrics(CollectorRegistry()), Clock()
    return Watchdog(timeout_s, metrics.worker_stalled, batch_wait_s=batch_wait_s, clock=clock), clock, metrics


def stalled_gauge(metrics: ServiceMetrics, device: str) -> float | None:
    return metrics.registry.get_sample_value("encoder_service_worker_stalled", {"device": device})


# --- the rule, on a fake clock ----------------------------------------------------------------------


def test_a_batch_unanswered_for_longer_than_the_timeout_stalls_its_device_until_it_is_answered():
    w, clock, metrics = watchdog(10.0)
    w.batch_started("cuda:0")
    clock.now += 10.0
    assert w.check({"cuda:0": UP}, None) and w.stalled == frozenset()  # at the timeout, not yet
    clock.now += 0.5
    assert not w.check({"cuda:0": UP}, None) and w.stalled == {"cuda:0"}
    assert stalled_gauge(metrics, "cuda:0") == 1
    w.batch_done("cuda:0")
    assert w.check({"cuda:0": UP}, None) and w.stalled == frozenset()
    assert stalled_gauge(metrics, "cuda:0") == 0


def test_an_idle_device_with_nothing_queued_is_never_stalled():
    w, clock, _ = watchdog(10.0)
    w.batch_started("cpu")
    w.batch_done("cpu")
    clock.now += 3600
    assert w.check({"cpu": UP}, None) and w.stalled == frozenset()


def test_a_device_that_keeps_answering_is_not_stalled_however_long_images_wait():
    w, clock, _ = watchdog(10.0)
    oldest = clock.now
    w.batch_started("cpu")
    for _ in range(30):  # busy for 5 minutes, one answer every 10 s, the queue never empty
        clock.now += 10.0
        w.batch_done("cpu")
        w.batch_started("cpu")
        assert w.check({"cpu": UP}, oldest)


def test_an_idle_device_that_leaves_queued_images_waiting_is_stalled():
    w, clock, _ = watchdog(10.0)
    clock.now += 100  # idle for long: that is no stall ...
    queued_at = clock.now
    clock.now += 5
    assert w.check({"cpu": UP}, queued_at)
    clock.now += 6  # ... but images waiting 11 s with nobody taking them is
    assert not w.check({"cpu": UP}, queued_at) and w.stalled == {"cpu"}


def test_images_left_queued_while_the_worker_waits_for_a_fuller_batch_are_no_stall():
    w, clock, _ = watchdog(1.0, batch_wait_s=2.0)  # --batch-wait-ms 2000 with a short timeout
    queued_at = clock.now
    clock.now += 2.5
    assert w.check({"cpu": UP}, queued_at)
    clock.now += 1.0
    assert not w.check({"cpu": UP}, queued_at)


def test_one_stalled_device_of_two_leaves_the_node_serving_on_the_other():
    w, clock, metrics = watchdog(10.0)
    w.batch_started("cuda:0")
    w.batch_started("cuda:1")
    clock.now += 11
    w.batch_done("cuda:1")
    assert w.check({"cuda:0": UP, "cuda:1": UP}, None) and w.stalled == {"cuda:0"}
    assert (stalled_gauge(metrics, "cuda:0"), stalled_gauge(metrics, "cuda:1")) == (1, 0)
    assert not w.check({"cuda:0": UP, "cuda:1": DOWN}, None)  # the other restarting: nobody serves


def test_a_dead_worker_is_stalled_even_with_the_progress_check_off_and_a_restarting_one_is_not():
    w, clock, metrics = watchdog(0.0)
    w.batch_started("cpu:0")
    clock.now += 3600
    assert not w.check({"cpu:0": DEAD, "cpu:1": DOWN}, clock.now - 3600)
    assert w.stalled == {"cpu:0"}  # DOWN is encoder_service_workers_up's business
    assert (stalled_gauge(metrics, "cpu:0"), stalled_gauge(metrics, "cpu:1")) == (1, 0)
    assert w.period_s == 1.0


# --- a real engine (in-process worker thread, the fake model) -------------------------------------------


def test_a_forward_stuck_past_the_timeout_stops_serving_and_its_end_serves_again(fake_model):
    async def main():
        async with running_engine(fake_model, watchdog_timeout_s=0.3) as engine:
            changes = []
            engine.on_serving_change = changes.append
            assert engine.serving and sample(engine, "encoder_service_worker_stalled", device="cpu") == 0
            blocker = await hold_worker(engine, fake_model)  # the forward waits on the model's gate
            await until(lambda: not engine.serving)
            assert sample(engine, "encoder_service_worker_stalled", device="cpu") == 1
            assert not blocker.done()
            fake_model.gate.set()
            (result,) = await blocker
            await until(lambda: engine.serving)
            assert sample(engine, "encoder_service_worker_stalled", device="cpu") == 0
            assert changes == [False, True] and not result.cache_hit

    asyncio.run(main())


def test_a_slow_forward_within_the_timeout_keeps_serving(fake_model):
    async def main():
        async with running_engine(fake_model, watchdog_timeout_s=30) as engine:
            blocker = await hold_worker(engine, fake_model)
            await asyncio.sleep(1.5)  # a check or two (one a second), well within the timeout
            assert engine.serving
            fake_model.gate.set()
            await blocker

    asyncio.run(main())


class WorkerThreadKilled(BaseException):
    """Not an Exception: the worker's per-batch handlers let it through, as they do a SystemExit."""


class _DyingModel:
    """The fake model whose forwards, once ``armed``, raise what the worker thread cannot survive."""

    def __init__(self, model) -> None:
        self._model = model
        self.armed = False

    def __getattr__(self, name):
        return getattr(self._model, name)

    def encode_inputs_async(self, inputs):
        if self.armed:
            raise WorkerThreadKilled
        return self._model.encode_inputs_async(inputs)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_in_process_worker_thread_stops_serving_even_with_the_progress_check_off(fake_model):
    model = _DyingModel(fake_model)

    async def main():
        async with running_engine(model, watchdog_timeout_s=0) as engine:
            model.armed = True
            request = asyncio.create_task(encode_all(engine, [patches(0, seed=1)]))
            await until(lambda: not engine.serving)
            assert sample(engine, "encoder_service_worker_stalled", device="cpu") == 1
            assert sample(engine, "encoder_service_workers_up", device="cpu") == 0
            request.cancel()  # nothing will ever answer it: its caller's deadline ends it
            await asyncio.gather(request, return_exceptions=True)

    asyncio.run(main())


def test_a_worker_that_misses_its_wake_up_while_images_wait_is_stalled_by_the_engines_own_queue_time(fake_model):
    """The idle-while-images-wait rule, with the timestamp the engine itself supplies: the batch
    queue's put loses its notify (a worker asleep that missed its wake-up), so the worker is idle,
    no batch in flight, while an image waits. Only the queue's own oldest_enqueued_at, passed by
    the engine's watch loop, can tell the watchdog; the notify given at last serves it again."""

    async def main():
        # 1.5 s: a busy host that pauses this process between the image's queueing and the check that
        # the engine still serves must not let the watchdog call the stall first.
        async with running_engine(fake_model, watchdog_timeout_s=1.5) as engine:
            queue = engine._queue
            changes = []
            engine.on_serving_change = changes.append

            def put_without_waking_the_worker(item):
                with queue._cond:
                    queue._items.append(item)

            queue.put = put_without_waking_the_worker
            # The worker asleep in take_batch, where only a notify wakes it: a worker not yet there (its
            # thread just started, on a busy host) would find the image as it arrives, wake-up or not.
            await until(lambda: len(queue._cond._waiters) == 1)
            request = asyncio.create_task(encode_all(engine, [patches(0, seed=7)]))
            await until(lambda: len(queue) == 1)
            assert engine.serving and queue.oldest_enqueued_at() is not None
            await until(lambda: not engine.serving)
            assert sample(engine, "encoder_service_worker_stalled", device="cpu") == 1
            assert not request.done() and len(queue) == 1  # still waiting: nobody took it
            del queue.put  # the class's own put again
            with queue._cond:
                queue._cond.notify()  # the wake-up, late
            (result,) = await request
            await until(lambda: engine.serving)
            assert sample(engine, "encoder_service_worker_stalled", device="cpu") == 0
            assert changes == [False, True] and not result.cache_hit

    asyncio.run(main())
