"""Megatron TP/PP-sharded checkpoint → HF safetensors (sharded, with index and config).

Stages are read memory-mapped one at a time and tensors leave through a shard writer
that holds at most one output shard, so peak memory is about one stage plus one shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from mindrl.checkpoint import megatron as mg
from mindrl.checkpoint.atomic import atomic_directory, check_target
from mindrl.models import hf_mapping as hfm
from mindrl.models import sharding
from mindrl.ckpt_convert.assets import ASSETS_DIR, copy_assets
from mindrl.ckpt_convert.safetensors_io import ShardedSafetensorsWriter, parse_size


def mcore_to_hf(load_dir: str | Path, save_dir: str | Path, hf_config_dir: str | Path | None = None,
                max_shard_size: str = "5GB", overwrite: bool = False, progress: bool = True) -> Path:
    """Convert; the checkpoint's completeness and the target are checked before writing."""
    max_bytes = parse_size(max_shard_size)
    iteration = mg.read_tracker(load_dir)
    args = mg.load_args(load_dir, iteration)
    arch, par = mg.arch_of(args), mg.parallel_of(args)
    for tp_rank in range(par.tp):
        for pp_rank in range(par.pp):
            mg.existing_rank_file(load_dir, iteration, tp_rank, pp_rank, par.pp)
    if hf_config_dir is not None and not (Path(hf_config_dir) / "config.json").is_file():
        raise FileNotFoundError(f"--hf-config-dir {hf_config_dir} has no config.json.")
    check_target(save_dir, overwrite)

    bar = tqdm(total=arch.num_layers, desc="mcore2hf", unit="layer", disable=not progress)
    with atomic_directory(save_dir, overwrite) as tmp:
        writer = ShardedSafetensorsWriter(tmp, max_bytes)
        dtype = None
        for pp_rank in range(par.pp):
            states = [mg.load_rank(load_dir, t, pp_rank, iteration=iteration)["model"] for t in range(par.tp)]
            _write_stage(states, arch, par, pp_rank, writer, bar)
            dtype = dtype or states[0][next(iter(states[0]))].dtype
            del states  # unmap this stage before the next is opened
        writer.close()
        _write_config_and_assets(Path(tmp), Path(load_dir), args, hf_config_dir, dtype)
    bar.close()
    return Path(save_dir)


def _write_stage(states: list[dict[str, torch.Tensor]], arch, par, pp_rank: int,
                 writer: ShardedSafetensorsWriter, bar: tqdm) -> None:
    """Join one stage's TP slices tensor by tensor and hand them to the writer in HF order."""

    def full(full_name: str, local_name: str) -> torch.Tensor:
        return sharding.merge_full_tensor(full_name, [s[local_name] for s in states], arch)

    first, count = par.first_layer_of_stages(arch)[pp_rank], par.layers_per_stage(arch)[pp_rank]
    if pp_rank == 0:
        writer.add(hfm.EMBEDDING[0], full(hfm.EMBEDDING[1], hfm.EMBEDDING[1]))
    for local in range(count):
        index = first + local
        mcore_layer = {s: full(hfm.mcore_layer_prefix(index) + s, hfm.mcore_layer_prefix(local) + s)
                       for s in sharding.layer_param_shapes(arch)}
        for name, tensor in hfm.mcore_to_hf_layer(mcore_layer, arch).items():
            writer.add(hfm.hf_layer_prefix(index) + name, tensor)
        bar.update(1)
    if pp_rank == par.pp - 1:
        writer.add(hfm.FINAL_NORM[0], full(hfm.FINAL_NORM[1], hfm.FINAL_NORM[1]))
        if not arch.tied_embeddings:
            writer.add(hfm.OUTPUT[0], full(hfm.OUTPUT[1], hfm.OUTPUT[1]))


def _write_config_and_assets(tmp: Path, load_dir: Path, args, hf_config_dir, dtype: torch.dtype) -> None:
    """config.json (the original one if known, with the stored dtype), plus tokenizer files etc."""
    stored_assets = load_dir / ASSETS_DIR
    if hf_config_dir is not None:
        config = json.loads((Path(hf_config_dir) / "config.json").read_text())
        copy_assets(hf_config_dir, tmp, skip=("config.json",))
    elif getattr(args, "hf_config", None):
        config = dict(args.hf_config)
        if stored_assets.is_dir():
            copy_assets(stored_assets, tmp, skip=("config.json",))
    else:
        config = hfm.hf_config_from_arch(mg.arch_of(args), getattr(args, "model_type_hf", "llama3"), dtype)
    config["dtype" if "dtype" in config else "torch_dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if not (tmp / "generation_config.json").is_file():
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
