#!/usr/bin/env bash
# tiny_qwen, HF -> Megatron into ./ckpt/tiny_qwen_tp1 at its CPU layout (TP=1 PP=1), for the actor_config.load
# of configs/rlxf/grpo_tiny_cpu.yaml (or sft_tiny_cpu). fp32, so whichever precision `bf16: auto` picks loses nothing.
# It has no published weights: make an HF model with tools/ckpt_convert/random_hf.py, or export one.
#   HF_DIR=./hf/tiny_qwen bash tools/ckpt_convert/tiny_qwen/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./hf/tiny_qwen}" "${TP:=1}" "${PP:=1}" "${DTYPE:=fp32}"
hf2mcore tiny_qwen qwen2 "$@"
