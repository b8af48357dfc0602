"""SIGTERM under load: in-flight requests complete, new ones get UNAVAILABLE, exit 0 in the grace period."""

import pytest

from encoder_service.benchmarks.reliability.scenarios import sigterm

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(180)]


def test_sigterm_under_load_finishes_in_flight_requests_and_refuses_new_ones(check_scenario, tmp_path):
    # Two 16384-patch forwards are in flight: ~10 s on a free 2-core box, up to ~19 s on a busy one.
    check_scenario(sigterm.run(streams=16, load_s=3.0, grace_s=45.0, log_dir=tmp_path))


def test_a_burst_of_calls_just_before_sigterm_gets_ok_or_unavailable_never_cancelled(check_scenario, tmp_path):
    # Fails against a server that calls server.stop() the moment SIGTERM arrives: gRPC core cancels
    # the calls it received but had not handed to a handler yet (grpc/grpc#41785).
    check_scenario(sigterm.run_burst(calls=300, before_s=0.1, log_dir=tmp_path))
