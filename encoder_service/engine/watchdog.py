"""Liveness watchdog: notices a device worker that died or stopped making progress.

A worker process that is killed is noticed by its pipe closing (process_worker.py). What that does
not see: a worker that is alive but stuck (a hung kernel, a driver waiting forever, a process that
was stopped) and a worker thread that an unexpected exception ended. Requests for such a device
would wait until their deadlines while health still said SERVING, and the load balancer would go on
sending more. Like SGLang's health check, the engine therefore notes when each device completes a
forward, and a device that has work (a batch in flight, or images queued that it should have taken)
and completed none for longer than ``--watchdog-timeout-s`` is stalled: the gauge
``encoder_service_worker_stalled{device}`` says so and, once no device is up and progressing,
health turns NOT_SERVING. The next completed forward clears it.

Everything here runs on the event loop (the worker callbacks are posted there); times are
``time.perf_counter()``, the clock ``WorkItem.enqueued_at`` uses.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping

from prometheus_client import Gauge

log = logging.getLogger(__name__)

# A device's state as its worker pool reports it (devices_pool.py): "up" serving, "down" starting or
# restarting (encoder_service_workers_up says so), "dead" nobody will ever take its work again.
UP, DOWN, DEAD = "up", "down", "dead"
MAX_PERIOD_S = 1.0  # a dead thread is noticed within this even with the progress check off


class Watchdog:
    def __init__(self, timeout_s: float, stalled: Gauge, *, batch_wait_s: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.timeout_s = timeout_s  # 0: no progress check (dead threads are still noticed)
        self._batch_wait_s = batch_wait_s  # --batch-wait-ms: a worker may leave images queued that long
        self._gauge = stalled
        self._clock = clock
        self._in_flight: dict[str, int] = {}  # batches handed to a device and not answered yet
        self._busy_since: dict[str, float] = {}  # when its first batch in flight was handed over
        self._last_done: dict[str, float] = {}  # when it last answered a batch (any outcome)
        self.stalled: frozenset[str] = frozenset()

    @property
    def period_s(self) -> float:
        """How often ``check`` should run: a stall is reported within timeout + period."""
        return min(MAX_PERIOD_S, self.timeout_s / 4) if self.timeout_s > 0 else MAX_PERIOD_S

    def batch_started(self, device: str) -> None:
        if not self._in_flight.get(device):
            self._busy_since[device] = self._clock()
        self._in_flight[device] = self._in_flight.get(device, 0) + 1

    def batch_done(self, device: str) -> None:
        """A batch came back, results or error: either way the device answered."""
        self._in_flight[device] = max(0, self._in_flight.get(device, 0) - 1)
        self._last_done[device] = self._clock()

    def check(self, states: Mapping[str, str], oldest_queued: float | None) -> bool:
        """Updates the stalled devices and their gauge; returns whether some device is up and
        progressing (the node can serve). ``oldest_queued``: when the image waiting longest for a
        forward was queued, None if none waits."""
        now = self._clock()
        stalled = frozenset(d for d, state in states.items()
                            if state == DEAD or (state == UP and self._stuck(d, now, oldest_queued)))
        for device in sorted(stalled - self.stalled):
            log.error("device worker %s %s: stalled until it completes a forward", device,
                      "died" if states[device] == DEAD else
                      f"has completed no forward for over {self.timeout_s:g} s while it had work")
        for device in sorted(self.stalled - stalled):
            log.warning("device worker %s makes progress again", device)
        self.stalled = stalled
        for device in states:
            self._gauge.labels(device=device).set(1 if device in stalled else 0)
        return any(state == UP and d not in stalled for d, state in states.items())

    def _stuck(self, device: str, now: float, oldest_queued: float | None) -> bool:
        if self.timeout_s <= 0:
            return False
        if self._in_flight.get(device):
            waiting_since = self._busy_since[device]
        elif oldest_queued is not None:  # idle while images wait: it should have taken them
            waiting_since = oldest_queued + self._batch_wait_s
        else:
            return False  # nothing to do is no stall
        return now - max(waiting_since, self._last_done.get(device, -math.inf)) > self.timeout_s
