# shellcheck shell=bash
# Sourced by every recipe in tools/ckpt_convert/: moves to the repository root, so relative paths read as
# they do in the trainer configs, and turns the environment into one cli/convert_ckpt.py command line.
#   PYTHON   the interpreter (default: python on PATH)
#   DRY_RUN  set: print the command instead of running it (tests/test_ckpt_recipes.py reads defaults this way)

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${PYTHON:=python}"

# Checkpoint folder suffix as the trainer configs name them: tp2pp2, or tp2 alone when PP=1; ep8 appended for
# an expert-parallel mixture of experts.
layout_name() {
  local name
  if [ "$PP" = 1 ]; then name="tp$TP"; else name="tp${TP}pp$PP"; fi
  if [ "${EP:-1}" != 1 ]; then name="${name}ep$EP"; fi
  echo "$name"
}

convert() {
  if [ -n "${DRY_RUN:-}" ]; then
    printf '%q ' "$PYTHON" cli/convert_ckpt.py "$@"
    echo
    exit 0
  fi
  exec "$PYTHON" cli/convert_ckpt.py "$@"
}

# hf2mcore ARCH FAMILY [flags]: HF_DIR -> MG_DIR (default ./ckpt/ARCH_<layout>), sharded TP x PP (x EP for a
# mixture of experts; NUM_LAYER_LIST for an uneven split), weights in DTYPE.
hf2mcore() {
  local arch="$1" family="$2"
  shift 2
  : "${HF_DIR:?set HF_DIR to the HF model folder to convert}" "${TP:=1}" "${PP:=1}" "${EP:=1}" "${DTYPE:=bf16}"
  : "${NUM_LAYER_LIST:=}" "${MG_DIR:=./ckpt/${arch}_$(layout_name)}"
  local args=(--load-model-type hf --save-model-type mg --load-dir "$HF_DIR" --save-dir "$MG_DIR"
              --model-type-hf "$family" --target-tensor-parallel-size "$TP" --target-pipeline-parallel-size "$PP"
              --params-dtype "$DTYPE")
  if [ "$EP" != 1 ]; then args+=(--target-expert-parallel-size "$EP"); fi
  # qwen2 implies the QKV bias; spelled out so the line reads like MindSpeed-LLM's for the same model
  if [ "$family" = qwen2 ] || [ "$family" = qwen2_moe ] || [ "$family" = qwen2_5_vl ] || [ "$family" = glm4_moe ]; then
    args+=(--add-qkv-bias)
  fi
  if [ -n "$NUM_LAYER_LIST" ]; then args+=(--num-layer-list "$NUM_LAYER_LIST"); fi
  convert "${args[@]}" "$@"
}

# mcore2hf [flags]: MG_DIR (its latest iteration, any TP/PP) -> HF_OUT (default MG_DIR_hf). config.json and
# tokenizer come from HF_CONFIG_DIR / TOKENIZER where set (non-empty), else from what hf2mcore stored in
# MG_DIR/hf_assets; a training run's checkpoint stores none, so without them config.json is rebuilt from
# the architecture and no tokenizer is written.
mcore2hf() {
  : "${MG_DIR:?set MG_DIR to the Megatron checkpoint to export}"
  : "${HF_OUT:=${MG_DIR%/}_hf}"
  local args=(--load-model-type mg --save-model-type hf --load-dir "$MG_DIR" --save-dir "$HF_OUT")
  if [ -n "${HF_CONFIG_DIR:-}" ]; then args+=(--hf-config-dir "$HF_CONFIG_DIR"); fi
  if [ -n "${TOKENIZER:-}" ]; then args+=(--tokenizer-model "$TOKENIZER"); fi
  convert "${args[@]}" "$@"
}

# reshard [flags]: MG_DIR -> MG_OUT (default MG_DIR_<layout>) at TP x PP (x EP), weights only.
reshard() {
  : "${MG_DIR:?set MG_DIR to the Megatron checkpoint to re-shard}" "${TP:?set TP}" "${PP:?set PP}"
  : "${NUM_LAYER_LIST:=}" "${MG_OUT:=${MG_DIR%/}_$(layout_name)}"
  local args=(--load-model-type mg --save-model-type mg --load-dir "$MG_DIR" --save-dir "$MG_OUT"
              --target-tensor-parallel-size "$TP" --target-pipeline-parallel-size "$PP")
  if [ "${EP:-1}" != 1 ]; then args+=(--target-expert-parallel-size "$EP"); fi
  if [ -n "$NUM_LAYER_LIST" ]; then args+=(--num-layer-list "$NUM_LAYER_LIST"); fi
  if [ -n "${HF_CONFIG_DIR:-}" ]; then args+=(--hf-config-dir "$HF_CONFIG_DIR"); fi
  convert "${args[@]}" "$@"
}
