"""Command line of cli/convert_ckpt.py, with the flag names of the MindSpeed-LLM converter."""

from __future__ import annotations

import argparse
import sys
import time

from mindrl.config import ConfigError
from mindrl.models.dtypes import DTYPES
from mindrl.models.hf_mapping import HF_MODEL_TYPES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convert_ckpt.py",
        description="Convert HF safetensors checkpoints to TP/PP-sharded Megatron checkpoints (hf -> mg) "
                    "and back (mg -> hf), exactly.")
    parser.add_argument("--load-model-type", choices=["hf", "mg"], required=True)
    parser.add_argument("--save-model-type", choices=["hf", "mg"], required=True)
    parser.add_argument("--load-dir", required=True, help="HF model directory or Megatron checkpoint")
    parser.add_argument("--save-dir", required=True, help="output directory (must be empty or absent)")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1, help="hf -> mg: TP size")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=1, help="hf -> mg: PP size")
    parser.add_argument("--num-layer-list", default=None, help="hf -> mg: uneven PP split, e.g. 10,14")
    parser.add_argument("--model-type-hf", choices=sorted(HF_MODEL_TYPES), default=None,
                        help="hf -> mg: architecture family of the HF model")
    parser.add_argument("--add-qkv-bias", action="store_true",
                        help="hf -> mg: the model has QKV biases (implied by qwen2)")
    parser.add_argument("--params-dtype", choices=sorted(DTYPES), default="bf16",
                        help="hf -> mg: dtype of the Megatron weights (default bf16)")
    parser.add_argument("--hf-config-dir", default=None,
                        help="mg -> hf: original HF directory whose config.json and tokenizer files to use "
                             "(default: the ones stored in the checkpoint at conversion)")
    parser.add_argument("--max-shard-size", default="5GB", help="mg -> hf: safetensors shard size")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --save-dir (only after the new one is complete)")
    parser.add_argument("--no-progress", action="store_true", help="no per-layer progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mindrl.ckpt_convert.hf2mcore import hf_to_mcore
    from mindrl.ckpt_convert.mcore2hf import mcore_to_hf

    start = time.perf_counter()
    try:
        if (args.load_model_type, args.save_model_type) == ("hf", "mg"):
            if args.model_type_hf is None:
                raise ConfigError(f"hf -> mg needs --model-type-hf (one of "
                                  f"{', '.join(sorted(HF_MODEL_TYPES))}).")
            hf_to_mcore(args.load_dir, args.save_dir, args.model_type_hf, args.target_tensor_parallel_size,
                        args.target_pipeline_parallel_size, args.num_layer_list, DTYPES[args.params_dtype],
                        args.add_qkv_bias, args.overwrite, progress=not args.no_progress)
        elif (args.load_model_type, args.save_model_type) == ("mg", "hf"):
            mcore_to_hf(args.load_dir, args.save_dir, args.hf_config_dir, args.max_shard_size, args.overwrite,
                        progress=not args.no_progress)
        else:
            raise ConfigError(f"--load-model-type {args.load_model_type} --save-model-type "
                              f"{args.save_model_type} is not a conversion; use hf -> mg or mg -> hf "
                              f"(re-shard a Megatron checkpoint by going through hf).")
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError, KeyError) as err:
        print(f"error: {err.args[0] if err.args else err}", file=sys.stderr)
        return 2
    print(f"[convert_ckpt] {args.load_model_type} -> {args.save_model_type}: wrote {args.save_dir} "
          f"in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
