#!/usr/bin/env bash
# GRPO on Qwen2.5-7B on one node: the driver starts a private Ray cluster of this node's devices.
#   bash examples/grpo/grpo_trainer_qwen25_7b.sh [Hydra overrides, e.g. actor_config.load=./ckpt/qwen25_7b_tp4]
# Convert the weights first (examples/ckpt/ckpt_convert_qwen25_hf2mcore.sh); CONFIG picks another
# configs/rlxf/ file. Devices and collective settings: examples/cluster_env.sh, docs/multinode.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/cluster_env.sh
unset RAY_ADDRESS  # one node: never join a cluster left running by something else
exec "$PYTHON" cli/train_grpo.py --config-name "${CONFIG:-grpo_qwen25_7b}" "$@"
