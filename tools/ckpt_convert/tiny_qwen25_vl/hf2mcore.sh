#!/usr/bin/env bash
# tiny_qwen25_vl, HF -> Megatron into ./ckpt/tiny_qwen25_vl_tp1 at its CPU layout (TP=1 PP=1), fp32, vision tower
# included. It has no published weights: make an HF model with tools/ckpt_convert/random_hf.py, or export one.
#   HF_DIR=./hf/tiny_qwen25_vl bash tools/ckpt_convert/tiny_qwen25_vl/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./hf/tiny_qwen25_vl}" "${TP:=1}" "${PP:=1}" "${DTYPE:=fp32}"
hf2mcore tiny_qwen25_vl qwen2_5_vl "$@"
