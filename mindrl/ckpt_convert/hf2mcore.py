"""HF safetensors → Megatron TP/PP-sharded checkpoint, one rank file at a time.

Each rank's tensor is filled straight from the memory-mapped HF tensors it is cut from
(tp_layout's pieces: one copy per byte, in the target shape and dtype), or is the mapped rows
themselves where it is an HF tensor's rows as stored. Peak memory is about one rank file: a
file is written before the next is built, into the same memory (buffers.RankBuffers), and an
HF tensor is mapped only while the tensor cut from it is filled.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from mindrl.checkpoint import chunks as ck
from mindrl.checkpoint import megatron as mg
from mindrl.checkpoint.atomic import atomic_directory, check_target
from mindrl.ckpt_convert.assets import ASSETS_DIR, copy_assets
from mindrl.ckpt_convert.buffers import RankBuffers
from mindrl.ckpt_convert.safetensors_io import HFWeights
from mindrl.ckpt_convert.tokenizer import copy_tokenizer, tokenizer_files
from mindrl.config import ConfigError, ModelArch, ParallelConfig, validate_parallel
from mindrl.models import hf_mapping as hfm
from mindrl.models import sharding, tp_layout

# Buffers some HF exports carry that are recomputed, not learned.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read_hf_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; --load-dir must be an HF model directory.")
    return json.loads(path.read_text())


def check_hf_tensors(weights: HFWeights, arch: ModelArch, mtp: list[str] = ()) -> None:
    """Every tensor the architecture needs is present in the shape config.json gives it, and every
    present tensor is used (`mtp`: the multi-token-prediction layers', carried as they are): a tensor cut by the
    config's shape from a differently shaped one would read its neighbour's bytes or drop rows without a word."""
    shapes = hfm.hf_param_shapes(arch)
    expected = set(shapes)
    present = {n for n in weights.names() if not n.endswith(_IGNORED_SUFFIXES)} - set(mtp)
    if arch.tied_embeddings and hfm.OUTPUT[0] in present:
        present.discard(hfm.OUTPUT[0])  # some exports save the tied head too; it is the embedding
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing:
        hint = " (a model without QKV biases named as qwen2?)" if "_proj.bias" in missing[0] else ""
        raise ConfigError(f"the HF checkpoint lacks {len(missing)} tensors the architecture needs, e.g. "
                          f"{missing[0]}{hint}; check --model-type-hf and the checkpoint.")
    if unexpected:
        qkv_bias = "_proj.bias" in unexpected[0]
        hint = " (QKV biases: a Qwen2-family model takes --model-type-hf qwen2)" if qkv_bias else ""
        raise ConfigError(f"the HF checkpoint has {len(unexpected)} tensors the architecture does not use, "
                          f"e.g. {unexpected[0]}{hint}; nothing is dropped silently, so fix --model-type-hf.")
    wrong = [name for name in shapes if weights.shape(name) != shapes[name]]
    if wrong:
        name = wrong[0]
        raise ConfigError(f"the HF checkpoint's {name} has shape {list(weights.shape(name))} but config.json "
                          f"gives {list(shapes[name])} ({len(wrong)} tensors differ); the weights and "
                          f"config.json are from different models, so pair them.")


def hf_to_mcore(load_dir: str | Path, save_dir: str | Path, model_type_hf: str, tp: int = 1, pp: int = 1,
                num_layer_list: str | None = None, params_dtype: torch.dtype = torch.bfloat16,
                add_qkv_bias: bool = False, overwrite: bool = False, progress: bool = True,
                tokenizer_model: str | Path | None = None, orm: bool = False, ep: int = 1) -> Path:
    """Convert; every check runs before the first byte is written. `orm`: the HF model is a reward
    model (*ForSequenceClassification), MindSpeed-LLM's --orm; `ep`: the experts' expert-parallel size."""
    config = read_hf_config(load_dir)
    arch = hfm.arch_from_hf_config(config, model_type_hf, name=Path(load_dir).name or "hf_model",
                                   add_qkv_bias=add_qkv_bias, orm=orm)
    par = ParallelConfig(tp, pp, num_layer_list=num_layer_list, expert_model_parallel_size=ep)
    validate_parallel(arch, par)
    weights = HFWeights(load_dir)
    mtp = hfm.mtp_names(weights.names(), arch, config)
    check_hf_tensors(weights, arch, mtp)
    tokenizer = tokenizer_files(tokenizer_model, arch.padded_vocab_size) if tokenizer_model else []
    check_target(save_dir, overwrite, inputs=(load_dir, tokenizer_model))

    args = mg.checkpoint_args(arch, par, params_dtype, model_type_hf=model_type_hf, hf_config=config)
    bar = tqdm(total=arch.num_layers * tp * par.ep, desc="hf2mcore", unit="slice", disable=not progress)
    buffers = RankBuffers()
    with atomic_directory(save_dir, overwrite) as tmp:
        for chunk in ck.chunk_layout(arch, par):
            shapes = [ck.expected_shapes(arch, par, chunk, ep_rank) for ep_rank in range(par.ep)]
            for tp_rank, ep_rank in itertools.product(range(tp), range(par.ep)):
                model = _build_rank(weights, arch, par, chunk, shapes[ep_rank], (tp_rank, ep_rank), params_dtype,
                                    buffers, bar)
                mg.save_rank(tmp, "release", tp_rank, chunk.pp_rank, model, args, ep_rank=ep_rank)
                del model  # unmaps what it took from the HF files before the next is built
                buffers.reuse()  # the next rank file is filled into this one's memory
        copy_assets(load_dir, Path(tmp) / ASSETS_DIR)
        if mtp:  # not trained: kept beside the config, bytes as stored, for mcore2hf to write back
            save_file({name: weights.get(name) for name in mtp}, Path(tmp) / ASSETS_DIR / hfm.MTP_FILE)
        copy_tokenizer(tokenizer, Path(tmp) / ASSETS_DIR)
        mg.write_tracker(tmp, "release")
    bar.close()
    return Path(save_dir)


def _build_rank(weights: HFWeights, arch: ModelArch, par: ParallelConfig, chunk: ck.Chunk,
                shapes: dict[str, tuple[int, ...]], rank: tuple[int, int], dtype: torch.dtype, buffers: RankBuffers,
                bar: tqdm) -> dict[str, torch.Tensor]:
    """The state dict of the rank file of (TP rank, EP rank), each tensor built straight from the mapped HF
    tensors."""
    model: dict[str, torch.Tensor] = {}
    tp_rank, ep_rank = rank
    names = ck.chunk_names(arch, chunk, sharding.expert_range(arch, par, ep_rank))

    def put(name: str, local: str) -> None:
        pieces = tp_layout.rank_pieces(arch, par.tp, name)[tp_rank]
        model[local] = _rank_tensor(weights, pieces, shapes[local], hfm.tensor_dtype(name, dtype), buffers, par.tp)

    if chunk.first:
        put(hfm.EMBEDDING[1], hfm.EMBEDDING[1])
        for _, name in hfm.vision_names(arch):
            put(name, name)
    for local in range(chunk.num_layers):
        index = chunk.first_layer + local
        for suffix in tp_layout.layer_suffixes(arch, index):
            name = hfm.mcore_layer_prefix(index) + suffix
            if name in names:  # an expert-parallel rank holds its own experts only
                put(name, names[name])
        bar.update(1)
    if chunk.last:
        put(hfm.FINAL_NORM[1], hfm.FINAL_NORM[1])
        if arch.has_output_layer:
            put(hfm.OUTPUT[1], hfm.OUTPUT[1])
        elif ck.holds_tied_copy(arch, par, chunk):
            put(hfm.EMBEDDING[1], hfm.OUTPUT[1])  # Megatron's copy of the tied embedding
        if arch.has_score_head:
            put(hfm.SCORE[1], hfm.SCORE[1])
    return model


def _rank_tensor(weights: HFWeights, pieces: list[tp_layout.Piece], shape: tuple[int, ...], dtype: torch.dtype,
                 buffers: RankBuffers, tp: int) -> torch.Tensor:
    """One rank's tensor: rows of one HF tensor as they are on disk are taken mapped, not copied
    (renamed tensors, replicated norms, vocabulary slices without padding); anything else is
    filled once, in its final shape and dtype, from HF tensors mapped for this tensor alone."""
    if len(pieces) == 1 and pieces[0].col_block is None and pieces[0].count == shape[0]:
        piece = pieces[0]
        if weights.dtype(piece.hf_name) == dtype:
            return weights.get(piece.hf_name, rows=(piece.hf_start, piece.hf_start + piece.count))
    source = {name: weights.get(name) for name in dict.fromkeys(p.hf_name for p in pieces)}
    return tp_layout.fill_rank_tensor(buffers.empty(shape, dtype), pieces, source, tp)
