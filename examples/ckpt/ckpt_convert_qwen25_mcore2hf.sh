#!/usr/bin/env bash
# Convert a Megatron checkpoint (any TP/PP) back into HF safetensors.
#   MG_DIR=./ckpt/qwen25_7b_tp2pp2 HF_OUT=./Qwen2.5-7B-trained bash examples/ckpt/ckpt_convert_qwen25_mcore2hf.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
MG_DIR="${MG_DIR:-./ckpt/qwen25_7b_tp2pp2}"
HF_OUT="${HF_OUT:-./Qwen2.5-7B-mindrl}"
args=(--load-model-type mg --save-model-type hf --load-dir "$MG_DIR" --save-dir "$HF_OUT")
[ -n "${HF_CONFIG_DIR:-}" ] && args+=(--hf-config-dir "$HF_CONFIG_DIR")
exec "${PYTHON:-python}" cli/convert_ckpt.py "${args[@]}" "$@"
