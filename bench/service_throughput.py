"""The service as users run it (a real server process, client processes, photo-like JPEGs): see
encoder_service/bench_service.py.

    python bench/service_throughput.py --model qwen2.5-vl-7b --device cuda --dtype bfloat16 \\
        --out results.json [-- EXTRA SERVE FLAGS]      (the same as: encoder-service bench --service ...)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from encoder_service.bench_service import main

if __name__ == "__main__":
    sys.exit(main())
