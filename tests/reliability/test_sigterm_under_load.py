"""SIGTERM under load: in-flight requests complete, new ones get UNAVAILABLE, exit 0 in the grace period."""

import pytest

from bench.reliability.scenarios import sigterm

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(180)]


def test_sigterm_under_load_finishes_in_flight_requests_and_refuses_new_ones(check_scenario, tmp_path):
    check_scenario(sigterm.run(streams=16, load_s=3.0, grace_s=20.0, log_dir=tmp_path))
