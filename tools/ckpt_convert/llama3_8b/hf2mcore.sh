#!/usr/bin/env bash
# Llama-3-8B, HF -> Megatron, sharded as configs/rlxf/grpo_llama3_8b.yaml trains it (TP=2 PP=1, bf16)
# and written where that config loads from (./ckpt/llama3_8b_tp2).
#   HF_DIR=./Meta-Llama-3-8B-Instruct bash tools/ckpt_convert/llama3_8b/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./Meta-Llama-3-8B-Instruct}" "${TP:=2}" "${PP:=1}" "${DTYPE:=bf16}"
hf2mcore llama3_8b llama3 "$@"
