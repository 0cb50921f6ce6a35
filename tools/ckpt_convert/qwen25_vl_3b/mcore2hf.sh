#!/usr/bin/env bash
# Qwen2.5-VL-3B-Instruct, Megatron (any TP/PP) -> HF, vision tower included: by default the latest checkpoint
# configs/rlxf/grpo_qwen25_vl_3b.yaml saved; config.json and the processor files come from ./Qwen2.5-VL-3B-Instruct.
#   MG_DIR=./ckpt/grpo_qwen25_vl_3b HF_OUT=./Qwen2.5-VL-3B-grpo bash tools/ckpt_convert/qwen25_vl_3b/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/grpo_qwen25_vl_3b}" "${HF_CONFIG_DIR=./Qwen2.5-VL-3B-Instruct}"
mcore2hf "$@"
