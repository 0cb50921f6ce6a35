"""Megatron TP/PP-sharded checkpoint → HF safetensors (sharded, with index and config).

Model chunks are read memory-mapped one at a time and tensors leave through a shard writer
that holds at most one output shard, so peak memory is about one stage plus one shard.
Every check (see megatron_source) runs before the first byte is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from mindrl.checkpoint.atomic import atomic_directory, check_target
from mindrl.checkpoint.chunks import Chunk
from mindrl.ckpt_convert.assets import copy_assets
from mindrl.ckpt_convert.megatron_source import MegatronSource, merged, open_megatron
from mindrl.ckpt_convert.safetensors_io import ShardedSafetensorsWriter, parse_size
from mindrl.ckpt_convert.tokenizer import copy_tokenizer, tokenizer_files
from mindrl.models import hf_mapping as hfm
from mindrl.models import sharding


def mcore_to_hf(load_dir: str | Path, save_dir: str | Path, hf_config_dir: str | Path | None = None,
                max_shard_size: str = "5GB", overwrite: bool = False, progress: bool = True,
                model_type_hf: str | None = None, tokenizer_model: str | Path | None = None) -> Path:
    """Convert; the checkpoint, the HF family, the tokenizer and the target are checked before writing."""
    max_bytes = parse_size(max_shard_size)
    source = open_megatron(load_dir, hf_config_dir, model_type_hf)
    family = source.model_type_hf or hfm.model_type_hf_of(source.arch)
    hfm.check_hf_can_hold(source.arch, family)
    tokenizer = tokenizer_files(tokenizer_model, source.hf_vocab) if tokenizer_model else []
    check_target(save_dir, overwrite)

    bar = tqdm(total=source.arch.num_layers, desc="mcore2hf", unit="layer", disable=not progress)
    with atomic_directory(save_dir, overwrite) as tmp:
        writer = ShardedSafetensorsWriter(tmp, max_bytes)
        for chunk in source.chunks:
            states = source.load_chunk(chunk)
            _write_stage(states, source, chunk, writer, bar)
            del states  # unmap this chunk before the next is opened
        writer.close()
        _write_config_and_assets(Path(tmp), source, family)
        copy_tokenizer(tokenizer, Path(tmp))
    bar.close()
    return Path(save_dir)


def _write_stage(states: list[dict[str, torch.Tensor]], source: MegatronSource, chunk: Chunk,
                 writer: ShardedSafetensorsWriter, bar: tqdm) -> None:
    """Join one chunk's TP slices tensor by tensor and hand them to the writer in HF order."""
    arch = source.arch

    def full(name: str, local: str) -> torch.Tensor:
        return merged(states, name, local, arch)

    if chunk.first:
        writer.add(hfm.EMBEDDING[0], full(hfm.EMBEDDING[1], hfm.EMBEDDING[1])[:source.hf_vocab])
    for local in range(chunk.num_layers):
        index = chunk.first_layer + local
        mcore_layer = {s: full(hfm.mcore_layer_prefix(index) + s, hfm.mcore_layer_prefix(local) + s)
                       for s in sharding.layer_param_shapes(arch)}
        for name, tensor in hfm.mcore_to_hf_layer(mcore_layer, arch).items():
            writer.add(hfm.hf_layer_prefix(index) + name, tensor)
        bar.update(1)
    if chunk.last:
        writer.add(hfm.FINAL_NORM[0], full(hfm.FINAL_NORM[1], hfm.FINAL_NORM[1]))
        if not arch.tied_embeddings:
            writer.add(hfm.OUTPUT[0], full(hfm.OUTPUT[1], hfm.OUTPUT[1])[:source.hf_vocab])


def _write_config_and_assets(tmp: Path, source: MegatronSource, family: str) -> None:
    """config.json (the original one if known, with the stored dtype), plus tokenizer files etc."""
    if source.hf_config is not None:
        config = dict(source.hf_config)
    else:
        config = hfm.hf_config_from_arch(source.arch, family, source.dtype)
    if source.assets_dir is not None:
        copy_assets(source.assets_dir, tmp, skip=("config.json",))
    config["dtype" if "dtype" in config else "torch_dtype"] = str(source.dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if not (tmp / "generation_config.json").is_file():
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
