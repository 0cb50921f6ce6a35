#!/usr/bin/env bash
# Llama-3.1-8B, Megatron (any TP/PP) -> HF: by default the latest checkpoint configs/rlxf/grpo_llama31_8b.yaml saved.
# Training checkpoints hold no HF files, so config.json and the tokenizer come from ./Llama-3.1-8B-Instruct.
#   MG_DIR=./ckpt/grpo_llama31_8b HF_OUT=./Llama-3.1-8B-grpo bash tools/ckpt_convert/llama31_8b/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/grpo_llama31_8b}" "${HF_CONFIG_DIR=./Llama-3.1-8B-Instruct}"
mcore2hf "$@"
