#!/usr/bin/env bash
# tiny_llama31, HF -> Megatron into ./ckpt/tiny_llama31_tp1 at its CPU layout (TP=1 PP=1), for the actor_config.load
# of configs/rlxf/grpo_tiny_cpu.yaml with model=[tiny_llama31]. fp32.
# It has no published weights: make an HF model with tools/ckpt_convert/random_hf.py, or export one.
#   HF_DIR=./hf/tiny_llama31 bash tools/ckpt_convert/tiny_llama31/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./hf/tiny_llama31}" "${TP:=1}" "${PP:=1}" "${DTYPE:=fp32}"
hf2mcore tiny_llama31 llama3 "$@"
