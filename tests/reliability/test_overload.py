"""Offered load several times capacity against a small queue: fast refusals, fast health checks and
cache hits, bounded admitted latency, a queue that never exceeds its bound, quick recovery."""

import pytest

from encoder_service.benchmarks.reliability.scenarios import overload

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(180)]


def test_overload_is_refused_fast_while_health_and_cache_hits_stay_fast(check_scenario, tmp_path):
    # Refusals must not wait in the queue: admitted requests take hundreds of ms here, so 150 ms
    # still tells one from the other, while a 2-core CI box running other tests beside this one
    # pushed the p99 just past the 50 ms the soak bench holds on its own machine (53.7 ms once).
    check_scenario(overload.run(duration_s=10.0, max_queue_images=4, log_dir=tmp_path, max_refusal_p99_s=0.15))
