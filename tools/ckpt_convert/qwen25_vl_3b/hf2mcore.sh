#!/usr/bin/env bash
# Qwen2.5-VL-3B-Instruct, HF -> Megatron, vision tower included, sharded as configs/rlxf/grpo_qwen25_vl_3b.yaml trains
# it (TP=2 PP=1, bf16) into ./ckpt/qwen25_vl_3b_tp2, where that config loads from.
#   HF_DIR=./Qwen2.5-VL-3B-Instruct bash tools/ckpt_convert/qwen25_vl_3b/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./Qwen2.5-VL-3B-Instruct}" "${TP:=2}" "${PP:=1}" "${DTYPE:=bf16}"
hf2mcore qwen25_vl_3b qwen2_5_vl "$@"
