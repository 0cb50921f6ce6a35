#!/usr/bin/env bash
# Qwen2.5-0.5B, HF -> Megatron into ./ckpt/qwen25_0p5b_tp1, bf16. No shipped trainer config trains it, so the
# layout is one device's (TP=1 PP=1); set TP/PP/NUM_LAYER_LIST to the layout of the config you write.
#   HF_DIR=./Qwen2.5-0.5B TP=2 PP=2 NUM_LAYER_LIST=10,14 bash tools/ckpt_convert/qwen25_0p5b/hf2mcore.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
: "${HF_DIR:=./Qwen2.5-0.5B}" "${TP:=1}" "${PP:=1}" "${DTYPE:=bf16}"
hf2mcore qwen25_0p5b qwen2 "$@"
