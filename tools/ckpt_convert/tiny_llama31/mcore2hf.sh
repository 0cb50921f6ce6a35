#!/usr/bin/env bash
# tiny_llama31, Megatron (any TP/PP) -> HF: by default the checkpoint hf2mcore.sh wrote; a run's (configs/rlxf/
# grpo_tiny_cpu.yaml with model=[tiny_llama31]) with MG_DIR, and the tokenizer it used (TOKENIZER= for none).
#   MG_DIR=runs/grpo_tiny_cpu/ckpt HF_OUT=./hf/tiny_llama31_grpo bash tools/ckpt_convert/tiny_llama31/mcore2hf.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${MG_DIR:=./ckpt/tiny_llama31_tp1}" "${TOKENIZER=data/tiny_tokenizer}"
mcore2hf "$@"
