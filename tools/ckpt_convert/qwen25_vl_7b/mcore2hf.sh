#!/usr/bin/env bash
# Qwen2.5-VL-7B-Instruct, Megatron (any TP/PP) -> HF, vision tower included: by default what hf2mcore.sh wrote, with
# the config.json and processor files it kept in hf_assets/.
#   MG_DIR=./ckpt/qwen25_vl_7b_tp4 HF_OUT=./Qwen2.5-VL-7B-back bash tools/ckpt_convert/qwen25_vl_7b/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/qwen25_vl_7b_tp4}"
mcore2hf "$@"
