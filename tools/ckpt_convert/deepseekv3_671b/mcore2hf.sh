#!/usr/bin/env bash
# DeepSeek-V3 / R1 (671B), Megatron (any TP/PP/EP) -> HF: by default the latest checkpoint configs/rlxf/
# grpo_deepseek_v3.yaml saved. Training checkpoints hold no HF files, so config.json and the tokenizer come from
# ./DeepSeek-V3; a trained trunk is written without the untrained MTP layer (num_nextn_predict_layers: 0).
#   MG_DIR=./ckpt/grpo_deepseek_v3 HF_OUT=./DeepSeek-V3-grpo bash tools/ckpt_convert/deepseekv3_671b/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/grpo_deepseek_v3}" "${HF_CONFIG_DIR=./DeepSeek-V3}"
mcore2hf "$@"
