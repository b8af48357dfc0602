"""ViT throughput on one GPU against transformers' reference: see encoder_service/bench.py.

    python bench/vit_throughput.py --out results.json     (the same as: encoder-service bench ...)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from encoder_service.bench import main

if __name__ == "__main__":
    sys.exit(main())
