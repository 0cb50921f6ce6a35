#!/usr/bin/env bash
# small_qwen, HF -> Megatron into ./ckpt/small_qwen_tp1 at its CPU layout (TP=1 PP=1), for the actor_config.load
# of configs/rlxf/grpo_small_cpu.yaml. fp32, so whichever precision `bf16: auto` picks loses nothing.
# It has no published weights: make an HF model with tools/ckpt_convert/random_hf.py, or export one.
#   HF_DIR=./hf/small_qwen bash tools/ckpt_convert/small_qwen/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./hf/small_qwen}" "${TP:=1}" "${PP:=1}" "${DTYPE:=fp32}"
hf2mcore small_qwen qwen2 "$@"
