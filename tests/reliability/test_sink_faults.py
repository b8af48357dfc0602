"""Sinks down, slow, flapping, acknowledging wrongly or never: one UNAVAILABLE after one bound, the
encoder healthy and serving others meanwhile, nothing stuck, memory bounded."""

import pytest

from encoder_service.benchmarks.reliability.scenarios import sink_faults

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(180)]


def test_every_sink_fault_is_one_unavailable_after_one_bound_and_others_are_served(check_scenario, tmp_path):
    check_scenario(sink_faults.run(sink_timeout_s=1.0, rounds=3, log_dir=tmp_path))
