"""``python -m encoder_service`` = the ``encoder-service`` command."""

import sys

from .cli import main

if __name__ == "__main__":  # a worker process started with spawn imports this module too
    sys.exit(main())
