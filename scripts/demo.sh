#!/usr/bin/env bash
# The README's main-job command: sets up .venv if needed, then runs the main job on the
# embedded tiny CPU model (offline). Extra args go to the job.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
exec "${MINDRL_VENV:-$ROOT/.venv}/bin/python" cli/parallel_check.py "$@"
