#!/usr/bin/env bash
# tiny_glm4_moe, Megatron (any TP/PP/EP) -> HF: by default the latest checkpoint configs/rlxf/grpo_tiny_moe_cpu.yaml
# saved, with the tokenizer that run used (data/tiny_tokenizer; TOKENIZER= for none).
#   MG_DIR=runs/grpo_tiny_moe_cpu/ckpt HF_OUT=./hf/tiny_glm4_moe_grpo bash tools/ckpt_convert/tiny_glm4_moe/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=runs/grpo_tiny_moe_cpu/ckpt}" "${TOKENIZER=data/tiny_tokenizer}"
mcore2hf "$@"
