#!/usr/bin/env bash
# DeepSeek-V3 / R1 (671B), HF -> Megatron, sharded as configs/rlxf/grpo_deepseek_v3.yaml trains it: TP=4, PP=8 with
# layers 7,7,8,8,8,8,8,7, its 256 experts over EP=8 (32 per rank), bf16, into ./ckpt/deepseekv3_671b_tp4pp8ep8, where
# that config loads from. The published weights are fp8 with scales: dequantise them to bf16 first (DeepSeek's
# fp8_cast_bf16.py). The MTP layer is kept beside the weights (hf_assets/) and written back by mcore2hf.sh.
#   HF_DIR=./DeepSeek-V3 bash tools/ckpt_convert/deepseekv3_671b/hf2mcore.sh [more cli/convert_ckpt.py flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./DeepSeek-V3}" "${TP:=4}" "${PP:=8}" "${EP:=8}" "${NUM_LAYER_LIST:=7,7,8,8,8,8,8,7}" "${DTYPE:=bf16}"
hf2mcore deepseekv3_671b deepseek_v3 "$@"
