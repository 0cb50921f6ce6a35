#!/usr/bin/env bash
# The README's main-job command: sets up .venv if needed, then runs the learning demo on the embedded
# 2.5M-parameter CPU model, offline: facts tokenizer -> times-table prompts (parquet) -> SFT warm start
# -> held-out evaluation -> (with --dpo: DPO on preference pairs -> evaluation) -> GRPO with vLLM-CPU rollouts
# -> evaluation again, curve PNG and before/after table (extra arguments go to cli/demo.py: --seed, --sft-steps,
# --dpo, --dpo-steps, --grpo-steps, --out, --png; --lora: GRPO trains LoRA adapters; --vision: the vision-language
# model on shape images instead; --tools: multi-turn GRPO with a sandboxed python tool on two-digit products;
# --rollout-mode one_step_off_policy|streaming|sync: GRPO with the vLLM engine on a core of its own).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
PY="${MINDRL_VENV:-$ROOT/.venv}/bin/python"
# deterministic and quick: rebuilt every time, so a changed recipe never meets stale data
if [[ " $* " == *" --vision "* ]]; then
  "$PY" cli/build_tiny_tokenizer.py --out data/tiny_vl_tokenizer --task shapes --vision-tokens
  "$PY" cli/preprocess_data.py --config-name shapes
elif [[ " $* " == *" --tools "* ]]; then
  "$PY" cli/build_tiny_tokenizer.py --out data/tools_tokenizer --task tools --vocab-size 512 --split-digits
  "$PY" cli/preprocess_data.py --config-name tools
else
  "$PY" cli/build_tiny_tokenizer.py --out data/facts_tokenizer --task facts --vocab-size 512 --split-digits
  "$PY" cli/preprocess_data.py --config-name facts
  "$PY" cli/preprocess_data.py --config-name facts_dpo
fi
exec "$PY" cli/demo.py "$@"
