#!/usr/bin/env bash
# Qwen3-30B-A3B, Megatron (any TP/PP/EP) -> HF: by default the latest checkpoint configs/rlxf/grpo_qwen3_30b_a3b.yaml
# saved. Training checkpoints hold no HF files, so config.json and the tokenizer come from ./Qwen3-30B-A3B.
#   MG_DIR=./ckpt/grpo_qwen3_30b_a3b HF_OUT=./Qwen3-30B-A3B-grpo bash tools/ckpt_convert/qwen3_30b_a3b/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/grpo_qwen3_30b_a3b}" "${HF_CONFIG_DIR=./Qwen3-30B-A3B}"
mcore2hf "$@"
