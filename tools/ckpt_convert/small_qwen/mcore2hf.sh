#!/usr/bin/env bash
# small_qwen, Megatron (any TP/PP) -> HF: by default the latest checkpoint configs/rlxf/grpo_small_cpu.yaml saved,
# with the tokenizer that run used (data/tiny_tokenizer; TOKENIZER= for none).
#   MG_DIR=runs/grpo_small_cpu/ckpt HF_OUT=./hf/small_qwen_grpo bash tools/ckpt_convert/small_qwen/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=runs/grpo_small_cpu/ckpt}" "${TOKENIZER=data/tiny_tokenizer}"
mcore2hf "$@"
