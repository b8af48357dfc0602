"""Hostile clips (decode bombs, big PNG frames, pixel bounds of 1e8, cancelled calls) beside normal
traffic: normal callers stay OK and about as fast as alone, hostile ones get caller error codes and
never INTERNAL or UNKNOWN, memory comes back and peaks within the configured budgets."""

import pytest

from encoder_service.benchmarks.reliability.scenarios import video_flood

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(180)]


def test_a_flood_of_hostile_clips_leaves_normal_callers_served_and_memory_bounded(check_scenario, tmp_path):
    check_scenario(video_flood.run(log_dir=tmp_path))
