#!/usr/bin/env bash
# Qwen2.5-1.5B, Megatron (any TP/PP) -> HF: by default hf2mcore.sh's output, whose hf_assets/ hold the
# source's config.json and tokenizer; for a training run's checkpoint set HF_CONFIG_DIR=./Qwen2.5-1.5B too.
#   MG_DIR=./ckpt/qwen25_1p5b_tp1 HF_OUT=./Qwen2.5-1.5B-mindrl bash tools/ckpt_convert/qwen25_1p5b/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/qwen25_1p5b_tp1}"
mcore2hf "$@"
