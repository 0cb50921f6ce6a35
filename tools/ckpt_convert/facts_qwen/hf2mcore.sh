#!/usr/bin/env bash
# facts_qwen, HF -> Megatron into ./ckpt/facts_qwen_tp1 at its CPU layout (TP=1 PP=1), for the load of
# configs/sft/sft_facts_cpu.yaml (grpo_facts_cpu starts from that run's output, at the same layout).
# fp32, so whichever precision `bf16: auto` picks loses nothing.
# It has no published weights: make an HF model with tools/ckpt_convert/random_hf.py, or export one.
#   HF_DIR=./hf/facts_qwen bash tools/ckpt_convert/facts_qwen/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./hf/facts_qwen}" "${TP:=1}" "${PP:=1}" "${DTYPE:=fp32}"
hf2mcore facts_qwen qwen2 "$@"
