#!/usr/bin/env bash
# facts_qwen, Megatron (any TP/PP) -> HF: by default the latest checkpoint configs/rlxf/grpo_facts_cpu.yaml saved,
# with the tokenizer that run used (data/facts_tokenizer; TOKENIZER= for none).
#   MG_DIR=runs/facts/grpo HF_OUT=./hf/facts_qwen_grpo bash tools/ckpt_convert/facts_qwen/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=runs/facts/grpo}" "${TOKENIZER=data/facts_tokenizer}"
mcore2hf "$@"
