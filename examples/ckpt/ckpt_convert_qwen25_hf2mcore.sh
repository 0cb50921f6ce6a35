#!/usr/bin/env bash
# Convert an HF Qwen2.5 checkpoint into a TP/PP-sharded Megatron checkpoint.
#   HF_DIR=./Qwen2.5-7B MG_DIR=./ckpt/qwen25_7b_tp2pp2 TP=2 PP=2 bash examples/ckpt/ckpt_convert_qwen25_hf2mcore.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
HF_DIR="${HF_DIR:-./Qwen2.5-7B}"
MG_DIR="${MG_DIR:-./ckpt/qwen25_7b_tp${TP:-2}pp${PP:-2}}"
args=(--load-model-type hf --save-model-type mg
      --target-tensor-parallel-size "${TP:-2}" --target-pipeline-parallel-size "${PP:-2}"
      --load-dir "$HF_DIR" --save-dir "$MG_DIR" --model-type-hf qwen2 --add-qkv-bias
      --params-dtype "${DTYPE:-bf16}")
[ -n "${NUM_LAYER_LIST:-}" ] && args+=(--num-layer-list "$NUM_LAYER_LIST")
exec "${PYTHON:-python}" cli/convert_ckpt.py "${args[@]}" "$@"
