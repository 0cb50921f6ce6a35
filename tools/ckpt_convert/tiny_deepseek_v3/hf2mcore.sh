#!/usr/bin/env bash
# tiny_deepseek_v3, HF -> Megatron into ./ckpt/tiny_deepseek_v3_tp1ep2 at its CPU layout (TP=1 PP=1, the experts at
# EP=2), for the actor_config.load of configs/rlxf/grpo_tiny_moe_cpu.yaml with model=[tiny_deepseek_v3]
# generate_config.backend=megatron (vLLM-CPU's multi-latent attention is refused). fp32.
# It has no published weights: make an HF model with tools/ckpt_convert/random_hf.py, or export one.
#   HF_DIR=./hf/tiny_deepseek_v3 bash tools/ckpt_convert/tiny_deepseek_v3/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./hf/tiny_deepseek_v3}" "${TP:=1}" "${PP:=1}" "${EP:=2}" "${DTYPE:=fp32}"
hf2mcore tiny_deepseek_v3 deepseek_v3 "$@"
