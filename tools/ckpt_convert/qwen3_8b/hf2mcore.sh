#!/usr/bin/env bash
# Qwen3-8B, HF -> Megatron: TP=2 PP=1, bf16, into ./ckpt/qwen3_8b_tp2 (no trainer config ships for it: pass the
# layout of the one you write).
#   HF_DIR=./Qwen3-8B bash tools/ckpt_convert/qwen3_8b/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./Qwen3-8B}" "${TP:=2}" "${PP:=1}" "${DTYPE:=bf16}"
hf2mcore qwen3_8b qwen3 "$@"
