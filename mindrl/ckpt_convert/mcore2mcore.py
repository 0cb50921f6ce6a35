"""Megatron checkpoint → the same weights under another TP / PP layout, without going through HF.

Each target rank file is built from the source's TP slices (the source chunk holding them
memory-mapped, one chunk at a time): a tensor whose TP cut does not change is the source slice
as it is; otherwise it is filled straight from the source slices (recut: one copy per byte,
following the same tp_layout as every other direction), so the result is bit-exact with
mg → hf → mg. Peak memory is about one target rank file plus the source chunk it is read from.
Only the model moves: optimizer, scheduler and RNG state are tied to the old layout and are not
carried over.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from mindrl.checkpoint import chunks as ck
from mindrl.checkpoint import megatron as mg
from mindrl.checkpoint import megatron_args
from mindrl.checkpoint.atomic import atomic_directory, check_target
from mindrl.ckpt_convert import recut
from mindrl.ckpt_convert.assets import ASSETS_DIR, copy_assets
from mindrl.ckpt_convert.buffers import RankBuffers
from mindrl.ckpt_convert.megatron_source import MegatronSource, open_megatron
from mindrl.ckpt_convert.tokenizer import copy_tokenizer, tokenizer_files
from mindrl.config import ConfigError, ParallelConfig, validate_parallel
from mindrl.models import hf_mapping as hfm
from mindrl.models import sharding, tp_layout


def mcore_to_mcore(load_dir: str | Path, save_dir: str | Path, tp: int = 1, pp: int = 1,
                   num_layer_list: str | None = None, overwrite: bool = False, progress: bool = True,
                   hf_config_dir: str | Path | None = None, model_type_hf: str | None = None,
                   tokenizer_model: str | Path | None = None, ep: int = 1) -> Path:
    """Re-shard; the source, the target layout, the tokenizer and the target are checked before writing."""
    source = open_megatron(load_dir, hf_config_dir, model_type_hf)
    if source.lora:  # the recut knows the base weights' cuts only: adapters would be dropped or the base missing
        raise ConfigError(f"{load_dir} is a LoRA checkpoint, which mg -> mg does not re-shard; export it merged "
                          f"with mg -> hf (its adapters with --save-lora-adapter), or re-shard its base.")
    arch = source.arch
    par = ParallelConfig(tp, pp, num_layer_list=num_layer_list, expert_model_parallel_size=ep)
    validate_parallel(arch, par)
    tokenizer = tokenizer_files(tokenizer_model, arch.padded_vocab_size) if tokenizer_model else []
    check_target(save_dir, overwrite, inputs=(load_dir, hf_config_dir, tokenizer_model))

    extra = {}
    if source.model_type_hf is not None:
        extra["model_type_hf"] = source.model_type_hf
    if source.hf_config is not None:
        extra["hf_config"] = source.hf_config
    args = megatron_args.checkpoint_args(arch, par, source.dtype, **extra)
    reader = _SourceSlices(source)
    buffers = RankBuffers()
    bar = tqdm(total=arch.num_layers * par.tp * par.ep, desc="mcore2mcore", unit="slice", disable=not progress)
    with atomic_directory(save_dir, overwrite) as tmp:
        for chunk in ck.chunk_layout(arch, par):
            shapes = [ck.expected_shapes(arch, par, chunk, ep_rank) for ep_rank in range(par.ep)]
            for tp_rank, ep_rank in itertools.product(range(par.tp), range(par.ep)):
                model = _build_rank(reader, par, chunk, shapes[ep_rank], (tp_rank, ep_rank), buffers, bar)
                mg.save_rank(tmp, source.iteration, tp_rank, chunk.pp_rank, model, args, ep_rank=ep_rank)
                del model  # with the reader's release, unmaps the source pages this file was read from
                reader.release()
                buffers.reuse()  # the next rank file is filled into this one's memory
        if source.assets_dir is not None:
            copy_assets(source.assets_dir, Path(tmp) / ASSETS_DIR)
            if source.mtp_file is not None:  # a weight file, which copy_assets leaves out
                shutil.copy2(source.mtp_file, Path(tmp) / ASSETS_DIR / hfm.MTP_FILE)
        copy_tokenizer(tokenizer, Path(tmp) / ASSETS_DIR)
        mg.write_tracker(tmp, source.iteration)
    bar.close()
    return Path(save_dir)


class _SourceSlices:
    """The source's TP slices of a tensor by full name, keeping only the chunk last read mapped."""

    def __init__(self, source: MegatronSource) -> None:
        self.source = source
        self.where = {name: (chunk, local) for chunk in source.chunks
                      for name, local in ck.chunk_names(source.arch, chunk).items()}
        self.chunk: ck.Chunk | None = None
        self.states: list[dict[str, torch.Tensor]] = []

    def __call__(self, name: str) -> list[torch.Tensor]:
        chunk, local = self.where[name]
        if chunk != self.chunk:
            self.release()  # unmap the previous chunk first
            self.states, self.chunk = self.source.load_chunk(chunk), chunk
        return [state[local] for state in self.states]

    def release(self) -> None:
        """Unmap the chunk, so the pages read from it stop counting, once no tensor uses it."""
        self.states, self.chunk = [], None


def _build_rank(source: _SourceSlices, par: ParallelConfig, chunk: ck.Chunk, shapes: dict[str, tuple[int, ...]],
                rank: tuple[int, int], buffers: RankBuffers, bar: tqdm) -> dict[str, torch.Tensor]:
    """The state dict of the target rank file of (TP rank, EP rank), in the source's order."""
    arch, tp_in = source.source.arch, source.source.par.tp
    tp_rank, ep_rank = rank
    model: dict[str, torch.Tensor] = {}

    def put(name: str, local: str) -> None:
        slices, target = source(name), tp_layout.rank_pieces(arch, par.tp, name)[tp_rank]
        if par.tp == tp_in and sum(piece.count for piece in target) == shapes[local][0]:
            model[local] = slices[tp_rank]  # the same cut, and no vocabulary padding to zero
        else:
            model[local] = recut.fill_rank_tensor(buffers.empty(shapes[local], slices[0].dtype), target,
                                                  tp_layout.rank_pieces(arch, tp_in, name), slices, par.tp, tp_in)

    names = ck.chunk_names(arch, chunk, sharding.expert_range(arch, par, ep_rank)).items()
    for layer, group in itertools.groupby(names, key=lambda item: _layer_of(item[0])):
        for name, local in group:
            put(name, local)
        if layer is not None:
            bar.update(1)
    if ck.holds_tied_copy(arch, par, chunk):
        put(hfm.EMBEDDING[1], hfm.OUTPUT[1])  # Megatron's copy of the tied embedding
    return model


def _layer_of(name: str) -> str | None:
    return name.split(".")[2] if name.startswith("decoder.layers.") else None
