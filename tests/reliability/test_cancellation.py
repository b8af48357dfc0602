"""Hundreds of callers cancel mid-stream, run out of deadline or are killed: the work stops, the
gauges return to 0, no job or cache pin leaks, the server keeps serving."""

import pytest

from encoder_service.benchmarks.reliability.scenarios import cancellation

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(180)]


def test_cancelled_and_expired_requests_leave_no_work_jobs_or_pins_behind(check_scenario, tmp_path):
    check_scenario(cancellation.run(callers=240, crashing=2, log_dir=tmp_path))
