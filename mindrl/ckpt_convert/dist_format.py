"""Conversion to and from megatron-core's distributed checkpoints (torch_dist), through Megatron's legacy layout.

A torch_dist checkpoint stores every tensor whole under megatron-core's names, so its weights are read by building
the model at TP = PP = EP = 1 in one process and loading it with megatron-core's own reader (the names of the
local layer spec, the fused QKV and gate/up layouts are megatron-core's, not re-derived here); the model is then
written as a legacy release checkpoint, from which the other directions run unchanged (mg → hf, mg → mg). The other
way, a legacy checkpoint re-cut to TP = PP = EP = 1 is loaded into that model and saved with megatron-core's
writer. Unlike the legacy directions this holds the whole model in memory and imports megatron-core.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import torch

from mindrl.checkpoint import files
from mindrl.checkpoint import megatron as mg
from mindrl.ckpt_convert.assets import ASSETS_DIR
from mindrl.config import ConfigError, ParallelConfig
from mindrl.config.lora import LoraConfig

WHOLE = ParallelConfig(1, 1)


def is_dist(load_dir: str | Path) -> bool:
    root = Path(load_dir)
    return (root / mg.TRACKER).is_file() and files.format_of(root) == files.FORMAT


def _whole_args(args: Any) -> Any:
    """The stored args with the layout of one rank: the legacy files written here hold the whole model."""
    args = copy.copy(args)
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = args.expert_model_parallel_size = 1
    args.num_layer_list = None
    for key in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                "virtual_pipeline_model_parallel_size"):
        if hasattr(args, key):
            setattr(args, key, None)
    return args


def dist_to_legacy(load_dir: str | Path, out_dir: str | Path, lora_base: str | Path | None = None) -> Path:
    """The torch_dist checkpoint at `load_dir` (its tracker's iteration) as a legacy release checkpoint at
    TP = PP = EP = 1 in `out_dir` (with its hf_assets/), a LoRA run's adapters kept beside the base they go on
    (an adapters-only one's base read from `lora_base`, else the run's recorded initial weights, and checked
    against the fingerprint it was saved with); refuses, in one sentence, one without args or without a base."""
    from mindrl.ckpt_convert.mcore2mcore import mcore_to_mcore
    from mindrl.launch import run_ranks

    root = Path(load_dir)
    iteration = mg.read_tracker(root)
    problem = files.damage(root, iteration) if iteration != "release" else None
    if problem:
        raise ConfigError(f"{problem}, so {root} cannot be converted; point --load-dir at a complete checkpoint.")
    common = files.first_state(root, iteration)
    if common.get("args") is None:
        raise ConfigError(f"{root} is a torch_dist checkpoint without args (a bare megatron-core save); start a run "
                          f"from it (actor_config.load) with the model yaml describing it, which reads it at any "
                          f"layout, and convert that run's checkpoint.")
    mg.arch_of(common["args"], str(root))  # an architecture mindrl cannot build: one sentence here, not in the rank
    base = adapters_base(common, lora_base)
    if (common.get("lora") or {}).get("adapters_only") and base is None:
        raise ConfigError(LoraConfig.no_base(root))
    scratch = Path(f"{out_dir}-base")
    try:
        if base is not None and files.format_of(base) != files.FORMAT:  # a legacy base, read whole
            mcore_to_mcore(base, scratch, 1, 1, None, False, False, None, None, None, 1)
            base = str(scratch)
        run_ranks(_dist_to_legacy_rank, 1, str(root), iteration, str(out_dir), None if base is None else str(base))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if (root / ASSETS_DIR).is_dir():
        shutil.copytree(root / ASSETS_DIR, Path(out_dir) / ASSETS_DIR)
    return Path(out_dir)


def adapters_base(common: dict[str, Any], lora_base: str | Path | None = None) -> str | None:
    """The base an adapters-only checkpoint's adapters go on: `lora_base` if given, else the run's initial weights
    (None for any other checkpoint, and where neither is known)."""
    if not (common.get("lora") or {}).get("adapters_only"):
        return None
    return str(lora_base) if lora_base else (common.get("extra") or {}).get("initial_weights")


def _dist_to_legacy_rank(rank: int, root: str, iteration: int | str, out_dir: str, base: str | None) -> None:
    from mindrl.checkpoint import dist
    from mindrl.distributed import init_model_parallel
    from mindrl.models import lora, sharding
    from mindrl.models.gpt import build_gpt_model, load_stage_weights

    common = files.first_state(root, iteration)
    arch = mg.arch_of(common.get("args"), root)
    init_model_parallel(WHOLE, arch=arch)
    model = build_gpt_model(arch, WHOLE, _stored_dtype(common.get("args")))
    if base is not None:  # an adapters-only run's base, whole
        if files.format_of(base) == files.FORMAT:
            dist.read_stage(model, base, mg.read_tracker(base))
        else:
            load_stage_weights(model, mg.load_rank(base, 0, 0, iteration=mg.read_tracker(base))["model"])
    record = common.get("lora")
    if record:  # a LoRA run's: its adapters read too, and recorded, so the legacy directions merge them
        full_names = {name: name for name in sharding.stage_names(arch, WHOLE, 0, 0).values()}
        lora.add_adapters(model, LoraConfig(tuple(record["target_modules"]), record["r"], record["alpha"]),
                          full_names, seed=0)
    if base is not None:
        differs = dist.fingerprint_differs(record["base_fingerprint"], dist.base_fingerprint(model))
        if differs:
            raise ConfigError(f"{root} holds LoRA adapters only, trained on other base weights than {base} "
                              f"({differs} differs); pass the base they were trained on with --lora-base.")
    dist.read_stage(model, root, iteration, only_trained=base is not None)
    weights = {name: param.detach() for name, param in model.named_parameters()}
    kept = {"lora": {**record, "adapters_only": False, "base_fingerprint": None}} if record else {}
    mg.save_rank(out_dir, "release", 0, 0, weights, _whole_args(common.get("args")), **kept)
    mg.write_tracker(out_dir, "release")


def _stored_dtype(args: Any) -> torch.dtype:
    """The model's dtype, as its args give it (Megatron-LM's `params_dtype`, else its bf16 / fp16 flags)."""
    dtype = getattr(args, "params_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) \
        else torch.float32


def legacy_to_dist(whole_dir: str | Path, save_dir: str | Path) -> None:
    """A legacy checkpoint at TP = PP = EP = 1 (`whole_dir`) written as torch_dist into `save_dir` at its iteration
    (weights only: a run starts from it), with its hf_assets/."""
    from mindrl.launch import run_ranks

    run_ranks(_legacy_to_dist_rank, 1, str(whole_dir), str(save_dir))
    if (Path(whole_dir) / ASSETS_DIR).is_dir():
        shutil.copytree(Path(whole_dir) / ASSETS_DIR, Path(save_dir) / ASSETS_DIR)


def _legacy_to_dist_rank(rank: int, whole_dir: str, save_dir: str) -> None:
    from mindrl.checkpoint import dist
    from mindrl.distributed import init_model_parallel
    from mindrl.models.gpt import build_gpt_model, load_stage_weights

    iteration = mg.read_tracker(whole_dir)
    contents = mg.load_rank(whole_dir, 0, 0, iteration=iteration)
    arch = mg.arch_of(contents["args"], whole_dir)
    init_model_parallel(WHOLE, arch=arch)
    model = build_gpt_model(arch, WHOLE, _stored_dtype(contents["args"]))
    load_stage_weights(model, contents["model"])
    folder = Path(save_dir) / mg.iteration_dir_name(iteration)
    folder.mkdir(parents=True)
    dist.save_weights(model, folder, {"args": contents["args"], "iteration": 0 if iteration == "release" else iteration,
                                      "checkpoint_version": mg.CHECKPOINT_VERSION})
    mg.write_tracker(save_dir, iteration)
