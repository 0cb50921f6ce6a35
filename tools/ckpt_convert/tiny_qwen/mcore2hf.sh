#!/usr/bin/env bash
# tiny_qwen, Megatron (any TP/PP) -> HF: by default the latest checkpoint configs/rlxf/grpo_tiny_cpu.yaml saved,
# with the tokenizer that run used (data/tiny_tokenizer; TOKENIZER= for none).
#   MG_DIR=runs/grpo_tiny_cpu/ckpt HF_OUT=./hf/tiny_qwen_grpo bash tools/ckpt_convert/tiny_qwen/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=runs/grpo_tiny_cpu/ckpt}" "${TOKENIZER=data/tiny_tokenizer}"
mcore2hf "$@"
