"""Megatron checkpoint → the same weights under another TP / PP layout, without going through HF.

Each target stage is built from full tensors joined from the source's TP slices (the source
chunk holding them memory-mapped, one chunk at a time) and cut again for the target, with the
same sharding functions as every other direction, so the result is bit-exact with mg → hf →
mg. Peak memory is one target stage plus one full tensor. Only the model moves: optimizer,
scheduler and RNG state are tied to the old layout and are not carried over.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from tqdm import tqdm

from mindrl.checkpoint import chunks as ck
from mindrl.checkpoint import megatron as mg
from mindrl.checkpoint import megatron_args
from mindrl.checkpoint.atomic import atomic_directory, check_target
from mindrl.ckpt_convert.assets import ASSETS_DIR, copy_assets
from mindrl.ckpt_convert.megatron_source import MegatronSource, merged, open_megatron
from mindrl.ckpt_convert.tokenizer import copy_tokenizer, tokenizer_files
from mindrl.config import ParallelConfig, validate_parallel
from mindrl.models import hf_mapping as hfm
from mindrl.models import sharding


def mcore_to_mcore(load_dir: str | Path, save_dir: str | Path, tp: int = 1, pp: int = 1,
                   num_layer_list: str | None = None, overwrite: bool = False, progress: bool = True,
                   hf_config_dir: str | Path | None = None, model_type_hf: str | None = None,
                   tokenizer_model: str | Path | None = None) -> Path:
    """Re-shard; the source, the target layout, the tokenizer and the target are checked before writing."""
    source = open_megatron(load_dir, hf_config_dir, model_type_hf)
    arch = source.arch
    par = ParallelConfig(tp, pp, num_layer_list=num_layer_list)
    validate_parallel(arch, par)
    tokenizer = tokenizer_files(tokenizer_model, arch.padded_vocab_size) if tokenizer_model else []
    check_target(save_dir, overwrite)

    extra = {}
    if source.model_type_hf is not None:
        extra["model_type_hf"] = source.model_type_hf
    if source.hf_config is not None:
        extra["hf_config"] = source.hf_config
    args = megatron_args.checkpoint_args(arch, par, source.dtype, **extra)
    reader = _FullTensors(source)
    bar = tqdm(total=arch.num_layers, desc="mcore2mcore", unit="layer", disable=not progress)
    with atomic_directory(save_dir, overwrite) as tmp:
        for pp_rank in range(par.pp):
            stage = _build_stage(reader, par, pp_rank, bar)
            for tp_rank in range(par.tp):
                mg.save_rank(tmp, source.iteration, tp_rank, pp_rank, stage[tp_rank], args)
            del stage  # before the next stage is built: peak memory is one stage
        if source.assets_dir is not None:
            copy_assets(source.assets_dir, Path(tmp) / ASSETS_DIR)
        copy_tokenizer(tokenizer, Path(tmp) / ASSETS_DIR)
        mg.write_tracker(tmp, source.iteration)
    bar.close()
    return Path(save_dir)


class _FullTensors:
    """Full (TP=1) tensors of the source by name, keeping only the chunk last read mapped."""

    def __init__(self, source: MegatronSource) -> None:
        self.source = source
        self.where = {name: (chunk, local) for chunk in source.chunks
                      for name, local in ck.chunk_names(source.arch, chunk).items()}
        self.chunk: ck.Chunk | None = None
        self.states: list[dict[str, torch.Tensor]] = []

    def __call__(self, name: str) -> torch.Tensor:
        chunk, local = self.where[name]
        if chunk != self.chunk:
            self.states = []  # unmap the previous chunk first
            self.states, self.chunk = self.source.load_chunk(chunk), chunk
        return merged(self.states, name, local, self.source.arch)


def _build_stage(full: _FullTensors, par: ParallelConfig, pp_rank: int, bar: tqdm) -> list[dict[str, torch.Tensor]]:
    """The state dicts of every TP rank of target stage `pp_rank`, in the source's order."""
    arch = full.source.arch
    stage: list[dict[str, torch.Tensor]] = [{} for _ in range(par.tp)]

    def put(name: str, local: str, tensor: torch.Tensor) -> None:
        for rank, piece in enumerate(sharding.split_full_tensor(name, tensor, arch, par)):
            stage[rank][local] = piece

    names = sharding.stage_names(arch, par, pp_rank).items()
    for layer, group in itertools.groupby(names, key=lambda item: _layer_of(item[0])):
        for name, local in group:
            put(name, local, full(name))
        if layer is not None:
            bar.update(1)
    if sharding.holds_tied_output_copy(arch, par, pp_rank):
        put(hfm.OUTPUT[1], hfm.OUTPUT[1], full(hfm.EMBEDDING[1]))
    return stage


def _layer_of(name: str) -> str | None:
    return name.split(".")[2] if name.startswith("decoder.layers.") else None
