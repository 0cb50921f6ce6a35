#!/usr/bin/env bash
# Qwen2-57B-A14B, HF -> Megatron: TP=4 PP=4 with its 64 experts over EP=4 (16 per rank), bf16, into
# ./ckpt/qwen2_57b_a14b_tp4pp4ep4.
#   HF_DIR=./Qwen2-57B-A14B bash tools/ckpt_convert/qwen2_57b_a14b/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./Qwen2-57B-A14B}" "${TP:=4}" "${PP:=4}" "${EP:=4}" "${DTYPE:=bf16}"
hf2mcore qwen2_57b_a14b qwen2_moe "$@"
