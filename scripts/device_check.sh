#!/usr/bin/env bash
# The prepared device check (docs/platforms.md): mindrl's Megatron path on one GPU without Ray or vLLM, run from
# this tree, into one JSON and a log.
#   bash scripts/device_check.sh [--device cuda|cpu] [--out DIR] [--wheels DIR] [--only CHECK,...]
# --out: $OUT where that is set (a lent machine's folder that comes back), else runs/device_check. A Python
# without megatron-core (a bare GPU image) first gets the wheels in --wheels (default .whl, fetched beforehand
# with scripts/device_wheels.sh) installed into a scratch folder; nothing is installed into that Python itself.
# --device cpu is the dry run: every check at tiny sizes, as the suite runs it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
device=cuda
out="${OUT:-runs/device_check}"
wheels=.whl
only=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --wheels) wheels="$2"; shift 2 ;;
    --only) only=(--only "$2"); shift 2 ;;
    *) echo "device_check: unknown argument $1; use --device, --out, --wheels or --only" >&2; exit 2 ;;
  esac
done
python="${MINDRL_VENV:-$ROOT/.venv}/bin/python"
[ -x "$python" ] || python=python3
if ! "$python" -c "import megatron.core" 2>/dev/null; then
  if ! ls "$wheels"/*.whl > /dev/null 2>&1; then
    echo "device_check: $python has no megatron-core and $wheels holds no wheels; fetch them here with" \
         "bash scripts/device_wheels.sh and carry $wheels along (docs/platforms.md)." >&2
    exit 2
  fi
  site="$(mktemp -d)/site"
  echo "device_check: installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels into a scratch folder"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1
mkdir -p "$out"
set +e
"$python" -m tests.device --device "$device" --out "$out" "${only[@]}" 2>&1 | tee "$out/device_check.log"
exit "${PIPESTATUS[0]}"
