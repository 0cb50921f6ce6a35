"""HF safetensors → Megatron TP/PP-sharded checkpoint, one pipeline stage at a time.

Peak memory is about one pipeline stage (all its TP slices) plus one layer in flight:
each HF tensor is read when its layer is converted and dropped once its slices are in
the stage being built, and a stage is written before the next one starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from mindrl.checkpoint import megatron as mg
from mindrl.checkpoint.atomic import atomic_directory, check_target
from mindrl.ckpt_convert.assets import ASSETS_DIR, copy_assets
from mindrl.ckpt_convert.safetensors_io import HFWeights
from mindrl.ckpt_convert.tokenizer import copy_tokenizer, tokenizer_files
from mindrl.config import ConfigError, ModelArch, ParallelConfig, validate_parallel
from mindrl.models import hf_mapping as hfm
from mindrl.models import sharding

# Buffers some HF exports carry that are recomputed, not learned.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read_hf_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; --load-dir must be an HF model directory.")
    return json.loads(path.read_text())


def check_hf_names(weights: HFWeights, arch: ModelArch) -> None:
    """Every tensor the architecture needs is present and every present tensor is used."""
    expected = set(hfm.hf_global_names(arch))
    for i in range(arch.num_layers):
        expected.update(hfm.hf_layer_prefix(i) + n for n in hfm.hf_layer_names(arch))
    present = {n for n in weights.names() if not n.endswith(_IGNORED_SUFFIXES)}
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


def hf_to_mcore(load_dir: str | Path, save_dir: str | Path, model_type_hf: str, tp: int = 1, pp: int = 1,
                num_layer_list: str | None = None, params_dtype: torch.dtype = torch.bfloat16,
                add_qkv_bias: bool = False, overwrite: bool = False, progress: bool = True,
                tokenizer_model: str | Path | None = None) -> Path:
    """Convert; every check runs before the first byte is written."""
    config = read_hf_config(load_dir)
    arch = hfm.arch_from_hf_config(config, model_type_hf, name=Path(load_dir).name or "hf_model",
                                   add_qkv_bias=add_qkv_bias)
    par = ParallelConfig(tp, pp, num_layer_list=num_layer_list)
    validate_parallel(arch, par)
    weights = HFWeights(load_dir)
    check_hf_names(weights, arch)
    tokenizer = tokenizer_files(tokenizer_model, arch.padded_vocab_size) if tokenizer_model else []
    check_target(save_dir, overwrite)

    args = mg.checkpoint_args(arch, par, params_dtype, model_type_hf=model_type_hf, hf_config=config)
    bar = tqdm(total=arch.num_layers, desc="hf2mcore", unit="layer", disable=not progress)
    with atomic_directory(save_dir, overwrite) as tmp:
        for pp_rank in range(pp):
            stage = _build_stage(weights, arch, par, pp_rank, params_dtype, bar)
            for tp_rank in range(tp):
                mg.save_rank(tmp, "release", tp_rank, pp_rank, stage[tp_rank], args)
            del stage  # before the next stage is built: peak memory is one stage
        copy_assets(load_dir, Path(tmp) / ASSETS_DIR)
        copy_tokenizer(tokenizer, Path(tmp) / ASSETS_DIR)
        mg.write_tracker(tmp, "release")
    bar.close()
    return Path(save_dir)


def _build_stage(weights: HFWeights, arch: ModelArch, par: ParallelConfig, pp_rank: int,
                 dtype: torch.dtype, bar: tqdm) -> list[dict[str, torch.Tensor]]:
    """The state dicts of every TP rank of pipeline stage `pp_rank`, read layer by layer."""
    stage: list[dict[str, torch.Tensor]] = [{} for _ in range(par.tp)]

    def put(full_name: str, local_name: str, tensor: torch.Tensor) -> None:
        for rank, piece in enumerate(sharding.split_full_tensor(full_name, tensor, arch, par)):
            stage[rank][local_name] = piece

    def put_vocab(hf_name: str, local_name: str) -> None:
        # Each rank's rows are contiguous on disk: read them alone rather than the whole
        # table plus its slices (the largest tensors, so this sets the peak).
        for rank in range(par.tp):
            start, stop, pad = sharding.vocab_rows(arch, par, rank)
            rows = weights.get(hf_name, rows=(start, stop)).to(dtype)
            stage[rank][local_name] = sharding.pad_vocab(rows, stop - start + pad)

    first, count = par.first_layer_of_stages(arch)[pp_rank], par.layers_per_stage(arch)[pp_rank]
    if pp_rank == 0:
        put_vocab(hfm.EMBEDDING[0], hfm.EMBEDDING[1])
    for local in range(count):
        index = first + local
        prefix = hfm.hf_layer_prefix(index)
        hf_layer = {n: weights.get(prefix + n).to(dtype) for n in hfm.hf_layer_names(arch)}
        for suffix, tensor in hfm.hf_to_mcore_layer(hf_layer, arch).items():
            put(hfm.mcore_layer_prefix(index) + suffix, hfm.mcore_layer_prefix(local) + suffix, tensor)
        bar.update(1)
    if pp_rank == par.pp - 1:
        put(hfm.FINAL_NORM[1], hfm.FINAL_NORM[1], weights.get(hfm.FINAL_NORM[0]).to(dtype))
        if not arch.tied_embeddings:
            put_vocab(hfm.OUTPUT[0], hfm.OUTPUT[1])
        elif sharding.holds_tied_output_copy(arch, par, pp_rank):
            put_vocab(hfm.EMBEDDING[0], hfm.OUTPUT[1])
    return stage
