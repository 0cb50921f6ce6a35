#!/usr/bin/env bash
# tiny_qwen25_vl, Megatron (any TP/PP) -> HF, vision tower included: by default the latest checkpoint
# configs/rlxf/grpo_tiny_vl_cpu.yaml saved, with the tokenizer that run used (data/tiny_vl_tokenizer; TOKENIZER= for none).
#   MG_DIR=runs/shapes/grpo HF_OUT=./hf/tiny_qwen25_vl_grpo bash tools/ckpt_convert/tiny_qwen25_vl/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=runs/shapes/grpo}" "${TOKENIZER=data/tiny_vl_tokenizer}"
mcore2hf "$@"
