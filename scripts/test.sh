#!/usr/bin/env bash
# The README's test command: sets up .venv if needed, then runs the test suite (extra args go to pytest).
#   bash scripts/test.sh            the whole suite (what .ci/run calls)
#   bash scripts/test.sh --quick    the tests that start no Ray job or vLLM engine and measure no benchmark, for the
#                                   edit loop
# Two pytest-xdist workers share the tests, a module to a worker (its module-scoped runs stay shared): on two
# cores this measured 16.5 -> 12.6 min for the suite and 3.5 -> 2.5 for the quick tier; `-n 0` runs in one process.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1 RAY_AUTH_MODE=disabled
exec "${MINDRL_VENV:-$ROOT/.venv}/bin/python" -m pytest -n 2 --dist loadscope "$@"
