#!/usr/bin/env bash
# Qwen2.5-32B, HF -> Megatron, sharded as configs/rlxf/grpo_qwen25_32b.yaml trains it (TP=4 PP=4, bf16)
# and written where that config loads from (./ckpt/qwen25_32b_tp4pp4).
#   HF_DIR=./Qwen2.5-32B bash tools/ckpt_convert/qwen25_32b/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./Qwen2.5-32B}" "${TP:=4}" "${PP:=4}" "${DTYPE:=bf16}"
hf2mcore qwen25_32b qwen2 "$@"
