#!/usr/bin/env bash
# Sets up .venv (torch CPU first, then the client and the service with test extras), then runs
# ruff and every test not marked gpu. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ruff check .
python -m pytest -m "not gpu" -q "$@"
