"""``python -m encoder_service`` = the ``encoder-service`` command."""

import sys

from .cli import main

sys.exit(main())
