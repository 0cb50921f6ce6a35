#!/usr/bin/env bash
# Qwen2.5-7B, HF -> Megatron, sharded as configs/rlxf/grpo_qwen25_7b.yaml trains it (TP=2 PP=2, bf16)
# and written where that config loads from (./ckpt/qwen25_7b_tp2pp2).
#   HF_DIR=./Qwen2.5-7B bash tools/ckpt_convert/qwen25_7b/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./Qwen2.5-7B}" "${TP:=2}" "${PP:=2}" "${DTYPE:=bf16}"
hf2mcore qwen25_7b qwen2 "$@"
