#!/usr/bin/env bash
# The README's test command: sets up .venv if needed, then runs the test suite (extra args go to pytest).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1 RAY_AUTH_MODE=disabled
exec "${MINDRL_VENV:-$ROOT/.venv}/bin/python" -m pytest "$@"
