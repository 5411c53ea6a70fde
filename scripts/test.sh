#!/usr/bin/env bash
# The project's test command: install (scripts/bootstrap.sh), lint, type-check, run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${VENV:-.venv}
export PATH="$(cd "$VENV/bin" && pwd):$PATH"  # hadolint and torchrun from the venv
"$VENV/bin/ruff" check megarl tests benchmarks setup.py
"$VENV/bin/mypy" megarl
set +e
# Two workers (pytest-xdist); a test file stays in one worker, so its module fixtures (engines) start once. Files are
# handed out in the order tests/conftest.py gives them (the most slow tests first), not by their number of tests.
"$VENV/bin/python" -m pytest -q -rs -n 2 --dist loadfile --no-loadscope-reorder --durations=40 "$@"
status=$?
set -e
if [[ $status -eq 5 ]]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit $status
