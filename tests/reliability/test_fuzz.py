"""Hypothesis over every EncodeRequest field and over hostile image bytes: no crash, no INTERNAL or
UNKNOWN, no hang, bounded responses, a healthy server afterwards."""

import pytest

from encoder_service.benchmarks.reliability.scenarios import fuzz

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(240)]


def test_fuzzed_requests_and_images_get_only_caller_error_codes(check_scenario, tmp_path):
    check_scenario(fuzz.run(max_examples=200, image_examples=200, log_dir=tmp_path))
