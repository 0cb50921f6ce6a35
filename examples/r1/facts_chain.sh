#!/usr/bin/env bash
# The R1 chain on the facts task, stage after stage on the same Megatron checkpoints, offline on CPU:
#   SFT -> evaluate -> DPO -> evaluate -> GRPO -> evaluate
# Each stage's `load` is the last stage's `save`, and its reference is those weights. The same chain as
# `bash scripts/demo.sh --dpo`, written out command by command:
#   bash examples/r1/facts_chain.sh [OUT]        (default runs/facts_chain; SFT_STEPS, DPO_STEPS, GRPO_STEPS
#                                                 shorten the stages, default: each config's train_iters)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
PY="${MINDRL_VENV:-$ROOT/.venv}/bin/python"
OUT="${1:-runs/facts_chain}"
steps() { if [ -n "${1:-}" ]; then echo "megatron_training.train_iters=$1"; fi; }

"$PY" cli/build_tiny_tokenizer.py --out data/facts_tokenizer --task facts --vocab-size 512 --split-digits
"$PY" cli/preprocess_data.py --config-name facts          # prompts: SFT's examples, GRPO's prompts, the test split
"$PY" cli/preprocess_data.py --config-name facts_dpo      # preference pairs: an answer chosen, a near miss rejected

evaluate() {
  "$PY" cli/evaluate.py --load "$OUT/$1" --data data/facts --tokenizer data/facts_tokenizer --max-tokens 16 \
    --max-model-len 96 --verifiers gsm8k answer_sentence --weights 1.0 0.1 --log "$OUT/evaluate.log"
}
"$PY" cli/train_sft.py --config-name sft_facts_cpu megatron_training.save="$OUT/sft" $(steps "${SFT_STEPS:-}")
evaluate sft
"$PY" cli/train_dpo.py --config-name dpo_facts_cpu megatron_training.load="$OUT/sft" \
  megatron_training.save="$OUT/dpo" $(steps "${DPO_STEPS:-}")
evaluate dpo
"$PY" cli/train_grpo.py --config-name grpo_facts_cpu actor_config.load="$OUT/dpo" \
  megatron_training.save="$OUT/grpo" $(steps "${GRPO_STEPS:-}")
evaluate grpo
