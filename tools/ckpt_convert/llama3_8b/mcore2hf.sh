#!/usr/bin/env bash
# Llama-3-8B, Megatron (any TP/PP) -> HF: by default the latest checkpoint configs/rlxf/grpo_llama3_8b.yaml saved.
# Training checkpoints hold no HF files, so config.json and the tokenizer come from ./Meta-Llama-3-8B-Instruct.
#   MG_DIR=./ckpt/grpo_llama3_8b HF_OUT=./Llama-3-8B-grpo bash tools/ckpt_convert/llama3_8b/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/grpo_llama3_8b}" "${HF_CONFIG_DIR=./Meta-Llama-3-8B-Instruct}"
mcore2hf "$@"
