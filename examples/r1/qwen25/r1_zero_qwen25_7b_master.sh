#!/usr/bin/env bash
# Multi-node R1-Zero GRPO on Qwen2.5-7B — the master node. Start r1_zero_qwen25_7b_worker.sh on every
# other node, before or after this one:
#   NNODES=2 MASTER_ADDR=10.0.0.1 SOCKET_IFNAME=eth0 bash examples/r1/qwen25/r1_zero_qwen25_7b_master.sh [overrides]
# Starts Ray's head here (dashboard off, bound to MASTER_ADDR), waits until NNODES nodes have joined
# (JOIN_TIMEOUT_S, default 600: then one sentence naming who is missing), trains CONFIG (default
# grpo_qwen25_7b, resources counted over all nodes) and stops this node's Ray when it ends.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source examples/cluster_env.sh
: "${MASTER_ADDR:?set MASTER_ADDR to the address of this node on the network the nodes share}"
MASTER_PORT="${MASTER_PORT:-6344}"
NNODES="${NNODES:-2}"
JOIN_TIMEOUT_S="${JOIN_TIMEOUT_S:-600}"

"$RAY" start --head --port "$MASTER_PORT" --node-ip-address "$MASTER_ADDR" --include-dashboard=false \
  --disable-usage-stats "${RAY_DEVICE_ARGS[@]}"
trap 'status=$?; "$RAY" stop >/dev/null 2>&1 || true; exit $status' EXIT
"$PYTHON" cli/wait_for_nodes.py --address "$MASTER_ADDR:$MASTER_PORT" --nodes "$NNODES" --timeout "$JOIN_TIMEOUT_S"
RAY_ADDRESS="$MASTER_ADDR:$MASTER_PORT" "$PYTHON" cli/train_grpo.py --config-name "${CONFIG:-grpo_qwen25_7b}" "$@"
