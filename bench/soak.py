"""``encoder-service bench reliability`` from a checkout, as a script: ``python bench/soak.py [options]``
runs this checkout's encoder_service/benchmarks/reliability/soak.py (see there)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's encoder_service, run as a file

from encoder_service.benchmarks.reliability.soak import main, markdown, rows, run_scenario  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
