#!/usr/bin/env bash
# Qwen2.5-7B, Megatron (any TP/PP) -> HF: by default the latest checkpoint configs/rlxf/grpo_qwen25_7b.yaml saved.
# Training checkpoints hold no HF files, so config.json and the tokenizer come from ./Qwen2.5-7B.
#   MG_DIR=./ckpt/grpo_qwen25_7b HF_OUT=./Qwen2.5-7B-grpo bash tools/ckpt_convert/qwen25_7b/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/grpo_qwen25_7b}" "${HF_CONFIG_DIR=./Qwen2.5-7B}"
mcore2hf "$@"
