#!/usr/bin/env bash
# tiny_qwen25_vl, Megatron (any TP/PP) -> HF: by default what hf2mcore.sh wrote, with the config.json it kept.
#   MG_DIR=./ckpt/tiny_qwen25_vl_tp1 HF_OUT=./hf/tiny_qwen25_vl_back bash tools/ckpt_convert/tiny_qwen25_vl/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/tiny_qwen25_vl_tp1}"
mcore2hf "$@"
