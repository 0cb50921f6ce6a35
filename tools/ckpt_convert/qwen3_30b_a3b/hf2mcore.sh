#!/usr/bin/env bash
# Qwen3-30B-A3B, HF -> Megatron: TP=4 PP=2 with its 128 experts over EP=8 (16 per rank), bf16, into
# ./ckpt/qwen3_30b_a3b_tp4pp2ep8.
#   HF_DIR=./Qwen3-30B-A3B bash tools/ckpt_convert/qwen3_30b_a3b/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./Qwen3-30B-A3B}" "${TP:=4}" "${PP:=2}" "${EP:=8}" "${DTYPE:=bf16}"
hf2mcore qwen3_30b_a3b qwen3_moe "$@"
