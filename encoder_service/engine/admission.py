"""Admission control: a bound on images admitted but not yet in a forward pass.

Over the bound a request is refused at once (RESOURCE_EXHAUSTED) rather than joining a queue that
only grows: the caller can retry elsewhere, and latency stays bounded for the admitted ones.
"""

from __future__ import annotations

from prometheus_client import Gauge

from ..errors import RETRY_AFTER_S, ResourceExhausted


class Admission:
    def __init__(self, max_waiting_images: int, waiting_gauge: Gauge) -> None:
        self.max_waiting_images = int(max_waiting_images)
        self.waiting = 0
        self._gauge = waiting_gauge  # encoder_service_queue_images

    def admit(self, n: int) -> None:
        """Takes ``n`` slots for one request, all or none."""
        if n <= 0:
            return
        if n > self.max_waiting_images:
            raise ResourceExhausted(
                f"request needs {n} new images encoded, more than --max-queue-images "
                f"{self.max_waiting_images} allows at once; split it")
        if self.waiting + n > self.max_waiting_images:
            raise ResourceExhausted(
                f"queue full: {self.waiting} images waiting, {n} more would exceed --max-queue-images "
                f"{self.max_waiting_images}; retry later or on another replica", retry_after_s=RETRY_AFTER_S)
        self.waiting += n
        self._gauge.set(self.waiting)

    def release(self, n: int = 1) -> None:
        self.waiting = max(0, self.waiting - n)
        self._gauge.set(self.waiting)
