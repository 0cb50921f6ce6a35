#!/usr/bin/env bash
# The README's main-job command: sets up .venv if needed, then runs the main job on the
# embedded tiny CPU model, offline: tiny tokenizer -> synthetic math prompts (parquet) ->
# GRPO with grpo_tiny_cpu (extra arguments are Hydra overrides of that config).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
PY="${MINDRL_VENV:-$ROOT/.venv}/bin/python"
[ -f data/tiny_tokenizer/tokenizer.json ] || "$PY" cli/build_tiny_tokenizer.py --out data/tiny_tokenizer
"$PY" cli/preprocess_data.py --config-name synthetic_math
exec "$PY" cli/train_grpo.py --config-name grpo_tiny_cpu "$@"
