#!/usr/bin/env bash
# Qwen3-30B-A3B, HF -> Megatron, sharded as configs/rlxf/grpo_qwen3_30b_a3b.yaml trains it: TP=4 PP=2 with its 128
# experts over EP=4 (32 per rank), bf16, into ./ckpt/qwen3_30b_a3b_tp4pp2ep4, where that config loads from.
#   HF_DIR=./Qwen3-30B-A3B bash tools/ckpt_convert/qwen3_30b_a3b/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./Qwen3-30B-A3B}" "${TP:=4}" "${PP:=2}" "${EP:=4}" "${DTYPE:=bf16}"
hf2mcore qwen3_30b_a3b qwen3_moe "$@"
