#!/usr/bin/env bash
# Qwen3-30B-A3B, Megatron (any TP/PP/EP) -> HF; config.json and the tokenizer come from ./Qwen3-30B-A3B.
#   MG_DIR=./ckpt/qwen3_30b_a3b_tp4pp2ep8 HF_OUT=./Qwen3-30B-A3B-out bash tools/ckpt_convert/qwen3_30b_a3b/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/qwen3_30b_a3b_tp4pp2ep8}" "${HF_CONFIG_DIR=./Qwen3-30B-A3B}"
mcore2hf "$@"
