#!/usr/bin/env bash
# Qwen2-57B-A14B, Megatron (any TP/PP/EP) -> HF; config.json and the tokenizer come from ./Qwen2-57B-A14B.
#   MG_DIR=./ckpt/qwen2_57b_a14b_tp4pp4ep4 HF_OUT=./Qwen2-57B-A14B-out bash tools/ckpt_convert/qwen2_57b_a14b/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/qwen2_57b_a14b_tp4pp4ep4}" "${HF_CONFIG_DIR=./Qwen2-57B-A14B}"
mcore2hf "$@"
