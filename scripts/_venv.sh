# Sourced by the scripts: creates .venv once and installs the project into it.
# torch goes first, pinned to the CPU build that is on disk; a looser pin would pull a CUDA build. The
# rest is held to the versions CI ran (scripts/test-constraints.txt).
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
if [ ! -x .venv/bin/encoder-service ] || [ ! -x .venv/bin/encoder-client ] || [ "${REINSTALL:-}" = 1 ] \
   || ! (cd / && python -c "import encoder_service, encoder_client, transformers, xdist") >/dev/null 2>&1; then
  echo "installing into .venv (log: .venv/install.log)..."
  if ! { python -m pip install --upgrade pip \
         && python -m pip install "torch==2.13.0" \
         && python -m pip install -c scripts/test-constraints.txt -e ./client \
         && python -m pip install -c scripts/test-constraints.txt -e ".[test]"; } > .venv/install.log 2>&1; then
    tail -40 .venv/install.log
    echo "install failed; full log in .venv/install.log" >&2
    exit 1
  fi
fi
