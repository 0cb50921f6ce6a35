#!/usr/bin/env bash
# Llama-3.1-8B (llama3 RoPE scaling, read from its config.json), HF -> Megatron, sharded as
# configs/rlxf/grpo_llama31_8b.yaml trains it (TP=2 PP=1, bf16) and written where that config loads from
# (./ckpt/llama31_8b_tp2).
#   HF_DIR=./Llama-3.1-8B-Instruct bash tools/ckpt_convert/llama31_8b/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./Llama-3.1-8B-Instruct}" "${TP:=2}" "${PP:=1}" "${DTYPE:=bf16}"
hf2mcore llama31_8b llama3 "$@"
