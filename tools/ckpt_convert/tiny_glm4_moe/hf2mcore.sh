#!/usr/bin/env bash
# tiny_glm4_moe, HF -> Megatron into ./ckpt/tiny_glm4_moe_tp1ep2 at its CPU layout (TP=1 PP=1, the experts at
# EP=2), for the actor_config.load of configs/rlxf/grpo_tiny_moe_cpu.yaml with model=[tiny_glm4_moe]. fp32.
# It has no published weights: make an HF model with tools/ckpt_convert/random_hf.py, or export one.
#   HF_DIR=./hf/tiny_glm4_moe bash tools/ckpt_convert/tiny_glm4_moe/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./hf/tiny_glm4_moe}" "${TP:=1}" "${PP:=1}" "${EP:=2}" "${DTYPE:=fp32}"
hf2mcore tiny_glm4_moe glm4_moe "$@"
