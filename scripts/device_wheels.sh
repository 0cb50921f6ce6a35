#!/usr/bin/env bash
# Fetches, on a machine with a package index, the wheels scripts/device_check.sh installs on a GPU image that has
# torch, transformers, safetensors, numpy, PyYAML and pytest but not megatron-core or OmegaConf (CPython 3.12,
# manylinux x86_64; about 2.9 MB together).
#   bash scripts/device_wheels.sh [DIR]    (default .whl: a folder git ignores, carried with the tree)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$ROOT/.whl}"
python="${MINDRL_VENV:-$ROOT/.venv}/bin/python"
[ -x "$python" ] || python=python3
mkdir -p "$dir"
# --no-deps each time: megatron-core needs only torch, numpy and packaging, OmegaConf PyYAML and ANTLR's runtime
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dir" "megatron-core==0.16.1" "omegaconf==2.3.1"
# the ANTLR runtime OmegaConf pins (4.9.3) is published as source only: built here into a pure-Python wheel
"$python" -m pip wheel -q --no-deps -w "$dir" "antlr4-python3-runtime==4.9.3"
ls -l "$dir"
