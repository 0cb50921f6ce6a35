#!/usr/bin/env bash
# Any architecture, Megatron -> Megatron at another TP/PP (mg -> mg). Weights only: no optimizer, scheduler or
# RNG state, so the result is a starting point (load it with no_load_optim and no_load_rng), not a resume.
#   MG_DIR=./ckpt/grpo_qwen25_7b TP=4 PP=1 MG_OUT=./ckpt/qwen25_7b_grpo_tp4 bash tools/ckpt_convert/reshard.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
reshard "$@"
