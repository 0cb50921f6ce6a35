#!/usr/bin/env bash
# The README's main-job command: sets up .venv if needed, then runs the main job on the
# embedded tiny CPU model, offline. Until the GRPO trainer lands that is the biggest real
# slice: tiny tokenizer -> synthetic math prompts (parquet) -> Megatron parallel checks.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
PY="${MINDRL_VENV:-$ROOT/.venv}/bin/python"
[ -f data/tiny_tokenizer/tokenizer.json ] || "$PY" cli/build_tiny_tokenizer.py --out data/tiny_tokenizer
"$PY" cli/preprocess_data.py --config-name synthetic_math
exec "$PY" cli/parallel_check.py "$@"
