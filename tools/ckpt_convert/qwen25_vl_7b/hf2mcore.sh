#!/usr/bin/env bash
# Qwen2.5-VL-7B-Instruct, HF -> Megatron, vision tower included: TP=4 PP=1, bf16, into ./ckpt/qwen25_vl_7b_tp4.
#   HF_DIR=./Qwen2.5-VL-7B-Instruct bash tools/ckpt_convert/qwen25_vl_7b/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./Qwen2.5-VL-7B-Instruct}" "${TP:=4}" "${PP:=1}" "${DTYPE:=bf16}"
hf2mcore qwen25_vl_7b qwen2_5_vl "$@"
