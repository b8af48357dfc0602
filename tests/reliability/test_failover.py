"""kill -9 of one of three encoders while a RoutingEncoderClient sends: no request is lost."""

import pytest

from encoder_service.benchmarks.reliability.scenarios import failover

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(240)]


def test_killing_one_of_three_encoders_loses_no_request(check_scenario, tmp_path):
    check_scenario(failover.run(senders=6, before_s=5.0, after_s=6.0, log_dir=tmp_path))
