#!/usr/bin/env bash
# Qwen2.5-32B, Megatron (any TP/PP) -> HF: by default the latest checkpoint configs/rlxf/grpo_qwen25_32b.yaml saved.
# Training checkpoints hold no HF files, so config.json and the tokenizer come from ./Qwen2.5-32B.
#   MG_DIR=./ckpt/grpo_qwen25_32b HF_OUT=./Qwen2.5-32B-grpo bash tools/ckpt_convert/qwen25_32b/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/grpo_qwen25_32b}" "${HF_CONFIG_DIR=./Qwen2.5-32B}"
mcore2hf "$@"
