#!/usr/bin/env bash
# Multi-node R1-Zero GRPO on Qwen2.5-7B — each worker node: joins the master's Ray cluster.
#   MASTER_ADDR=10.0.0.1 NODE_ADDR=10.0.0.2 SOCKET_IFNAME=eth0 bash examples/r1/qwen25/r1_zero_qwen25_7b_worker.sh
# Retries every RETRY_S seconds (default 5) until the head answers and `ray start --address` succeeds
# (JOIN_TIMEOUT_S, default 600), so the nodes may be started in any order; the node then serves until the
# master's run ends (stop it with `ray stop`).
set -euo pipefail
cd "$(dirname "$0")/../../.."
source examples/cluster_env.sh
: "${MASTER_ADDR:?set MASTER_ADDR to the address of the master node}"
: "${NODE_ADDR:?set NODE_ADDR to the address of this node on the network the nodes share}"
MASTER_PORT="${MASTER_PORT:-6344}"
JOIN_TIMEOUT_S="${JOIN_TIMEOUT_S:-600}"
RETRY_S="${RETRY_S:-5}"

# `ray start --address` itself waits minutes for a head that is not up yet, so the head's port is
# probed first and each start is bounded: the time limit holds and the wait says what it waits for.
attempt_log="$(mktemp)"
trap 'rm -f "$attempt_log"' EXIT
deadline=$((SECONDS + JOIN_TIMEOUT_S))
until timeout 5 bash -c "exec 3<>/dev/tcp/$MASTER_ADDR/$MASTER_PORT" 2>/dev/null &&
    timeout 120 "$RAY" start --address "$MASTER_ADDR:$MASTER_PORT" --node-ip-address "$NODE_ADDR" \
      --disable-usage-stats "${RAY_DEVICE_ARGS[@]}" >"$attempt_log" 2>&1; do
  if (( SECONDS >= deadline )); then
    cat "$attempt_log" >&2
    echo "error: the head at $MASTER_ADDR:$MASTER_PORT did not take this node within $JOIN_TIMEOUT_S s; start" \
         "r1_zero_qwen25_7b_master.sh there and check this node reaches it (SOCKET_IFNAME, firewall)." >&2
    exit 1
  fi
  echo "[mindrl] the head at $MASTER_ADDR:$MASTER_PORT does not answer yet; retrying in $RETRY_S s"
  sleep "$RETRY_S"
done
echo "[mindrl] joined the cluster at $MASTER_ADDR:$MASTER_PORT as $NODE_ADDR"
