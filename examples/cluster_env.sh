# Sourced by the example scripts: devices, the collective library's variables, and the tools to run.
#   DEVICE            npu | gpu | cpu (default: npu if npu-smi is found, else gpu if nvidia-smi is, else cpu)
#   DEVICES_PER_NODE  devices (or CPU cores) this node gives Ray (default 8; cpu: all cores)
#   SOCKET_IFNAME     the network interface the nodes reach each other on (e.g. eth0); every collective
#                     library and Ray's object transfers are bound to it
#   COLLECTIVE_TIMEOUT_S  seconds a collective may wait before it fails the run (default 1800)
#   PYTHON, RAY       the interpreter and the ray command (default: python, ray on PATH)
# See docs/multinode.md for what each variable does on each platform.

PYTHON="${PYTHON:-python}"
RAY="${RAY:-ray}"
if [ -z "${DEVICE:-}" ]; then
  if command -v npu-smi >/dev/null 2>&1; then DEVICE=npu
  elif command -v nvidia-smi >/dev/null 2>&1; then DEVICE=gpu
  else DEVICE=cpu; fi
fi
case "$DEVICE" in
  npu) RAY_DEVICE_ARGS=(--resources "{\"NPU\": ${DEVICES_PER_NODE:-8}}") ;;
  gpu) RAY_DEVICE_ARGS=(--num-gpus "${DEVICES_PER_NODE:-8}") ;;
  cpu) RAY_DEVICE_ARGS=(--num-cpus "${DEVICES_PER_NODE:-$(nproc)}") ;;
  *) echo "error: DEVICE=$DEVICE is not npu, gpu or cpu; set it to the devices this node has." >&2; exit 2 ;;
esac

if [ -n "${SOCKET_IFNAME:-}" ]; then
  export GLOO_SOCKET_IFNAME="$SOCKET_IFNAME" NCCL_SOCKET_IFNAME="$SOCKET_IFNAME" HCCL_SOCKET_IFNAME="$SOCKET_IFNAME"
  export TP_SOCKET_IFNAME="$SOCKET_IFNAME"
fi
COLLECTIVE_TIMEOUT_S="${COLLECTIVE_TIMEOUT_S:-1800}"
# A lost peer must fail a collective, not hang it: NCCL aborts on errors and timeouts, HCCL's waits are bounded.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-$COLLECTIVE_TIMEOUT_S}"
export HCCL_EXEC_TIMEOUT="${HCCL_EXEC_TIMEOUT:-$COLLECTIVE_TIMEOUT_S}"
export RAY_DEDUP_LOGS="${RAY_DEDUP_LOGS:-0}"
