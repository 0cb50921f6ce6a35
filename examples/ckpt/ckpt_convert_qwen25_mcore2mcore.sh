#!/usr/bin/env bash
# Re-shard a Megatron checkpoint (mindrl, Megatron-LM or MindSpeed-LLM) to another TP/PP layout, exactly.
#   MG_DIR=./ckpt/qwen25_7b_tp2pp2 MG_OUT=./ckpt/qwen25_7b_tp4pp1 TARGET_TP=4 TARGET_PP=1 \
#       bash examples/ckpt/ckpt_convert_qwen25_mcore2mcore.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
MG_DIR="${MG_DIR:-./ckpt/qwen25_7b_tp2pp2}"
MG_OUT="${MG_OUT:-./ckpt/qwen25_7b_tp${TARGET_TP:-4}pp${TARGET_PP:-1}}"
args=(--load-model-type mg --save-model-type mg --load-dir "$MG_DIR" --save-dir "$MG_OUT"
      --target-tensor-parallel-size "${TARGET_TP:-4}" --target-pipeline-parallel-size "${TARGET_PP:-1}")
[ -n "${TARGET_NUM_LAYER_LIST:-}" ] && args+=(--num-layer-list "$TARGET_NUM_LAYER_LIST")
[ -n "${HF_CONFIG_DIR:-}" ] && args+=(--hf-config-dir "$HF_CONFIG_DIR")
exec "${PYTHON:-python}" cli/convert_ckpt.py "${args[@]}" "$@"
