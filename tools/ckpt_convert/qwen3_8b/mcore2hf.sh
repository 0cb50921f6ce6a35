#!/usr/bin/env bash
# Qwen3-8B, Megatron (any TP/PP) -> HF; config.json and the tokenizer come from the checkpoint's hf_assets/ (what
# hf2mcore.sh stored), or from HF_CONFIG_DIR for a training checkpoint.
#   MG_DIR=./ckpt/qwen3_8b_tp2 HF_OUT=./Qwen3-8B-out bash tools/ckpt_convert/qwen3_8b/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/qwen3_8b_tp2}"
mcore2hf "$@"
