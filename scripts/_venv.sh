# Sourced by the scripts: creates .venv once and installs the project into it.
# torch goes first, pinned to the CPU build that is on disk; a looser pin would pull a CUDA build.
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
if ! python -c "import encoder_service, encoder_client, transformers" >/dev/null 2>&1 || [ "${REINSTALL:-}" = 1 ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ./client
  python -m pip install -q -e ".[test]"
fi
