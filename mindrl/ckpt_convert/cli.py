"""Command line of cli/convert_ckpt.py, with the flag names of the MindSpeed-LLM converter.

A flag that means nothing for the chosen direction is refused rather than ignored, so a
mistyped direction or a flag left over from another command line costs one sentence.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from mindrl.checkpoint.atomic import atomic_directory, check_target
from mindrl.config import ConfigError
from mindrl.models.dtypes import DTYPES
from mindrl.models.hf_mapping import HF_MODEL_TYPES

HF2MG, MG2HF, MG2MG = "hf -> mg", "mg -> hf", "mg -> mg"
# Flags (by dest) that mean something only in some directions.
_DIRECTIONS = {
    "target_tensor_parallel_size": (HF2MG, MG2MG),
    "target_expert_parallel_size": (HF2MG, MG2MG),
    "target_pipeline_parallel_size": (HF2MG, MG2MG),
    "num_layer_list": (HF2MG, MG2MG),
    "add_qkv_bias": (HF2MG,),
    "orm": (HF2MG,),
    "params_dtype": (HF2MG,),
    "hf_config_dir": (MG2HF, MG2MG),
    "max_shard_size": (MG2HF,),
    "lora_base": (MG2HF,),
    "save_lora_adapter": (MG2HF,),
    "ckpt_format": (HF2MG, MG2MG),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        """One line, like every other input error of the converter."""
        print(f"error: {message} (see {self.prog} --help).", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="convert_ckpt.py",
        description="Convert HF safetensors checkpoints to TP/PP-sharded Megatron checkpoints (hf -> mg), back "
                    "(mg -> hf), and Megatron checkpoints to another TP/PP layout (mg -> mg), exactly. Megatron "
                    "checkpoints written by mindrl, Megatron-LM or MindSpeed-LLM are read.")
    parser.add_argument("--load-model-type", choices=["hf", "mg"], required=True)
    parser.add_argument("--save-model-type", choices=["hf", "mg"], required=True)
    parser.add_argument("--load-dir", required=True, help="HF model directory or Megatron checkpoint")
    parser.add_argument("--save-dir", required=True, help="output directory (must be empty or absent)")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=None,
                        help="hf -> mg, mg -> mg: TP size (default 1)")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                        help="hf -> mg, mg -> mg: PP size (default 1)")
    parser.add_argument("--target-expert-parallel-size", type=int, default=None,
                        help="hf -> mg, mg -> mg: expert-parallel size of a mixture-of-experts model (default 1); "
                             "rank folders mp_rank_TT[_PPP]_EEE as Megatron-LM and MindSpeed-LLM write them")
    parser.add_argument("--num-layer-list", default=None, help="hf -> mg, mg -> mg: uneven PP split, e.g. 10,14")
    parser.add_argument("--model-type-hf", choices=sorted(HF_MODEL_TYPES), default=None,
                        help="architecture family of the HF model: required for hf -> mg; for mg -> hf / "
                             "mg -> mg only with a checkpoint whose args do not describe it")
    parser.add_argument("--add-qkv-bias", action="store_true",
                        help="hf -> mg: the model has QKV biases (implied by qwen2; refused for llama and "
                             "qwen3, whose HF models cannot hold them)")
    parser.add_argument("--orm", action="store_true",
                        help="hf -> mg: the HF model is an outcome reward model (*ForSequenceClassification); "
                             "its score head becomes Megatron's rm_head (mg -> hf / mg -> mg read it from the "
                             "checkpoint)")
    parser.add_argument("--params-dtype", choices=sorted(DTYPES), default=None,
                        help="hf -> mg: dtype of the Megatron weights (default bf16; mg -> * keep theirs)")
    parser.add_argument("--hf-config-dir", "--hf-cfg-dir", default=None,
                        help="mg -> hf, mg -> mg: original HF directory whose config.json and tokenizer files to "
                             "use (default: the ones stored in the checkpoint at conversion); also describes the "
                             "architecture of a checkpoint whose args do not")
    parser.add_argument("--max-shard-size", default=None, help="mg -> hf: safetensors shard size (default 5GB)")
    parser.add_argument("--lora-base", default=None,
                        help="mg -> hf of an adapters-only LoRA checkpoint (lora_ckpt_filter): the Megatron "
                             "checkpoint (same layout) its adapters were trained on, merged into it (default: the "
                             "initial_weights the run recorded); refused unless its digest is the one recorded")
    parser.add_argument("--save-lora-adapter", default=None, metavar="DIR",
                        help="mg -> hf of a LoRA checkpoint: also write its adapters to DIR as a PEFT adapter "
                             "folder (adapter_config.json, adapter_model.safetensors) for "
                             "peft.PeftModel.from_pretrained(<base HF model>, DIR); --save-dir gets the merged "
                             "weights either way")
    parser.add_argument("--tokenizer-model", default=None,
                        help="a tokenizer file (e.g. tokenizer.json) or a directory of them: its tokenizer "
                             "files are copied into the output (hf_assets/ of a Megatron checkpoint, beside "
                             "the weights of an HF one), replacing the source's, after checking that every "
                             "token id has an embedding row")
    parser.add_argument("--ckpt-format", choices=["torch", "torch_dist"], default=None,
                        help="hf -> mg, mg -> mg: the Megatron output's format (default torch, per-rank files); "
                             "torch_dist is megatron-core's distributed checkpoint, which loads at any layout (so "
                             "it takes no --target-* sizes). A torch_dist --load-dir is read whatever this is")
    parser.add_argument("--model-type", default="GPT",
                        help="MindSpeed-LLM's model type; only GPT (decoder-only) is converted")
    parser.add_argument("--use-mcore-models", action="store_true",
                        help="accepted for MindSpeed-LLM command lines; no effect (always megatron-core)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --save-dir (only after the new one is complete)")
    parser.add_argument("--no-progress", action="store_true", help="no per-layer progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    direction = f"{args.load_model_type} -> {args.save_model_type}"
    start = time.perf_counter()
    try:
        _check_flags(args, direction)
        tp, pp = _size(args, "target_tensor_parallel_size"), _size(args, "target_pipeline_parallel_size")
        ep = _size(args, "target_expert_parallel_size")
        with _through_legacy(args, direction, tp * pp * ep) as legacy_args:
            _convert(legacy_args, direction, tp, pp, ep)
        if direction == MG2MG:
            _say_weights_only(args.load_dir)
    except (ConfigError, OSError, ValueError, KeyError) as err:
        print(f"error: {err.args[0] if len(err.args) == 1 else err}", file=sys.stderr)
        return 2
    print(f"[convert_ckpt] {direction}: wrote {args.save_dir} in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)
    return 0


def _convert(args: argparse.Namespace, direction: str, tp: int, pp: int, ep: int) -> None:
    from mindrl.ckpt_convert.hf2mcore import hf_to_mcore
    from mindrl.ckpt_convert.mcore2hf import mcore_to_hf
    from mindrl.ckpt_convert.mcore2mcore import mcore_to_mcore

    progress = not args.no_progress
    if direction == HF2MG:
        hf_to_mcore(args.load_dir, args.save_dir, args.model_type_hf, tp, pp, args.num_layer_list,
                    DTYPES[args.params_dtype or "bf16"], args.add_qkv_bias, args.overwrite, progress,
                    args.tokenizer_model, args.orm, ep)
    elif direction == MG2HF:
        mcore_to_hf(args.load_dir, args.save_dir, args.hf_config_dir, args.max_shard_size or "5GB",
                    args.overwrite, progress, args.model_type_hf, args.tokenizer_model, args.lora_base,
                    args.save_lora_adapter)
    else:
        mcore_to_mcore(args.load_dir, args.save_dir, tp, pp, args.num_layer_list, args.overwrite, progress,
                       args.hf_config_dir, args.model_type_hf, args.tokenizer_model, ep)


@contextlib.contextmanager
def _through_legacy(args: argparse.Namespace, direction: str, ranks: int) -> Iterator[argparse.Namespace]:
    """The conversion's flags with torch_dist input and output replaced by legacy checkpoints of the whole model
    in a scratch folder beside --save-dir (mindrl/ckpt_convert/dist_format.py); the flags as given otherwise."""
    from mindrl.ckpt_convert import dist_format

    reads = args.load_model_type == "mg" and dist_format.is_dist(args.load_dir)
    writes = args.save_model_type == "mg" and args.ckpt_format == "torch_dist"
    if not reads and not writes:
        yield args
        return
    if writes and (ranks > 1 or args.num_layer_list):
        raise ConfigError("--ckpt-format torch_dist stores whole tensors, which load at any TP / PP / EP layout; "
                          "remove the --target-* sizes and --num-layer-list.")
    target = check_target(args.save_dir, args.overwrite, [args.load_dir, args.hf_config_dir, args.tokenizer_model])
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        legacy = argparse.Namespace(**vars(args))
        if reads:  # an adapters-only checkpoint's base is read there, so the legacy one holds it
            legacy.load_dir = str(dist_format.dist_to_legacy(args.load_dir, scratch / "input", args.lora_base))
            legacy.lora_base = None
        if writes:
            legacy.save_dir, legacy.overwrite = str(scratch / "whole"), False
        yield legacy
        if writes:
            with atomic_directory(target, args.overwrite) as out:
                dist_format.legacy_to_dist(scratch / "whole", out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _say_weights_only(load_dir: str) -> None:
    """Re-sharding carries the weights alone (optimizer, scheduler and RNG state belong to the old layout): a
    training checkpoint's user should know its copy starts a run rather than resumes one."""
    from mindrl.checkpoint import files
    from mindrl.checkpoint import megatron as mg

    iteration = mg.read_tracker(load_dir)
    if iteration != "release" and files.holds_training_state(load_dir, iteration):
        print(f"[convert_ckpt] {load_dir} iteration {iteration} is a training checkpoint: the re-sharded copy keeps "
              f"its weights only (optimizer, scheduler, RNG and data position stay behind), so a run starts from it "
              f"(actor_config.load) at step 0 rather than resuming it.", file=sys.stderr)


def _check_flags(args: argparse.Namespace, direction: str) -> None:
    if direction not in (HF2MG, MG2HF, MG2MG):
        raise ConfigError(f"--load-model-type {args.load_model_type} --save-model-type {args.save_model_type} "
                          f"is not a conversion; use hf -> mg, mg -> hf or mg -> mg.")
    if args.model_type.upper() != "GPT":
        raise ConfigError(f"--model-type {args.model_type} is not supported; mindrl converts GPT (decoder-only) "
                          f"models only.")
    if direction == HF2MG and args.model_type_hf is None:
        raise ConfigError(f"hf -> mg needs --model-type-hf (one of {', '.join(sorted(HF_MODEL_TYPES))}).")
    for dest, directions in _DIRECTIONS.items():
        if getattr(args, dest) not in (None, False) and direction not in directions:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag} applies to {' and '.join(directions)} only, not {direction}; remove it.")


def _size(args: argparse.Namespace, dest: str) -> int:
    """A parallel size flag, 1 where it is not given; 0 is refused, not read as absent."""
    value = getattr(args, dest)
    if value is None:
        return 1
    if value < 1:
        raise ConfigError(f"--{dest.replace('_', '-')} must be a positive integer, got {value}.")
    return value
