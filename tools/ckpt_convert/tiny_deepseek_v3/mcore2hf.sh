#!/usr/bin/env bash
# tiny_deepseek_v3, Megatron (any TP/PP/EP) -> HF: by default the checkpoint hf2mcore.sh wrote; a run's (configs/rlxf/
# grpo_tiny_moe_cpu.yaml with model=[tiny_deepseek_v3] generate_config.backend=megatron) with MG_DIR, and the tokenizer it used (TOKENIZER= for none).
#   MG_DIR=runs/grpo_tiny_moe_cpu/ckpt HF_OUT=./hf/tiny_deepseek_v3_grpo bash tools/ckpt_convert/tiny_deepseek_v3/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/tiny_deepseek_v3_tp1ep2}" "${TOKENIZER=data/tiny_tokenizer}"
mcore2hf "$@"
