"""64 concurrent streams of mixed images against one server: no error but the intended
RESOURCE_EXHAUSTED, no stall, RSS and cache bytes flat after warm-up."""

import pytest

from encoder_service.benchmarks.reliability.scenarios import sustained

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(240)]


def test_sixty_four_streams_of_mixed_images_run_without_errors_and_memory_stays_flat(check_scenario, tmp_path):
    # RSS climbs for the first ~20 s (allocator arenas, per-shape kernel caches): warm up past that
    # (a fresh-clone CI run grew 15% after 8 s). Over 30 s the level between trims (~530 MiB) moves
    # by a few percent (four runs: -1% to +3%; the lowest sample, used before, moved -4% to +9% and
    # once +11.6% in CI), so this short run allows 10%; the 5% bound is the soak's (bench/soak.py,
    # 10 minutes: -17% in the README's table).
    check_scenario(sustained.run(duration_s=30.0, warmup_s=30.0, streams=64, log_dir=tmp_path, max_growth=0.10))
