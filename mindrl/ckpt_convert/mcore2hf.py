"""Megatron TP/PP-sharded checkpoint → HF safetensors (sharded, with index and config).

Model chunks are read memory-mapped one at a time; each HF tensor is filled straight from the TP
slices it is made of (tp_layout's pieces: one copy per byte, where joining the slices and
splitting QKV / gate-up again copied twice) and leaves through a shard writer that holds at most
one output shard, so peak memory is about one chunk plus one shard. Every check (see
megatron_source) runs before the first byte is written.

A LoRA run's checkpoint is written merged, W + (alpha / r)·B·A, and optionally also as a PEFT adapter
folder (lora_export: an adapters-only checkpoint's base is found and checked there; a merged chunk is one more
copy of the chunk in memory).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from mindrl.checkpoint import chunks as ck
from mindrl.checkpoint.atomic import atomic_directory, check_target
from mindrl.ckpt_convert.assets import copy_assets
from mindrl.ckpt_convert.megatron_source import MegatronSource, open_megatron
from mindrl.ckpt_convert.safetensors_io import ShardedSafetensorsWriter, parse_size
from mindrl.ckpt_convert.tokenizer import copy_tokenizer, tokenizer_files
from mindrl.config import ConfigError
from mindrl.models import hf_mapping as hfm
from mindrl.models import sharding, tp_layout


def mcore_to_hf(load_dir: str | Path, save_dir: str | Path, hf_config_dir: str | Path | None = None,
                max_shard_size: str = "5GB", overwrite: bool = False, progress: bool = True,
                model_type_hf: str | None = None, tokenizer_model: str | Path | None = None,
                lora_base: str | Path | None = None, lora_adapter_dir: str | Path | None = None) -> Path:
    """Convert; the checkpoint, the HF family, the tokenizer, a LoRA checkpoint's base (`lora_base`, else the one
    it records) and the targets are checked before writing. `lora_adapter_dir`: also write a LoRA checkpoint's
    adapters there as a PEFT adapter folder."""
    max_bytes = parse_size(max_shard_size)
    source = open_megatron(load_dir, hf_config_dir, model_type_hf)
    family = source.model_type_hf or hfm.model_type_hf_of(source.arch)
    hfm.check_hf_can_hold(source.arch, family)
    tokenizer = tokenizer_files(tokenizer_model, source.hf_vocab) if tokenizer_model else []
    adapters = None
    if source.lora or lora_base is not None or lora_adapter_dir is not None:
        from mindrl.ckpt_convert import lora_export as adapters  # megatron-core: only for a LoRA checkpoint

        base = adapters.open_base(source, lora_base)
        if lora_adapter_dir is not None:
            if not source.lora:
                raise ConfigError(f"--save-lora-adapter needs a LoRA checkpoint, but {load_dir} has no adapters; "
                                  f"remove it.")
            unplaceable = adapters.peft_cannot_place(source)
            if unplaceable:
                raise ConfigError(f"--save-lora-adapter: PEFT could not place the adapters of {load_dir} on the HF "
                                  f"model ({unplaceable}); export the merged weights without it.")
            check_target(lora_adapter_dir, overwrite, inputs=(load_dir, hf_config_dir, tokenizer_model, lora_base))
            if Path(lora_adapter_dir).resolve() == Path(save_dir).resolve():
                raise ConfigError("--save-lora-adapter must be another directory than --save-dir.")
    check_target(save_dir, overwrite, inputs=(load_dir, hf_config_dir, tokenizer_model, lora_base,
                                              lora_adapter_dir))

    bar = tqdm(total=source.arch.num_layers, desc="mcore2hf", unit="layer", disable=not progress)
    with atomic_directory(save_dir, overwrite) as tmp:
        writer = ShardedSafetensorsWriter(tmp, max_bytes)
        for chunk in source.chunks:
            states = adapters.merged_chunk(source, base, chunk) if source.lora else source.load_chunk(chunk)
            _write_stage(states, source, chunk, writer, bar)
            del states  # unmap this chunk before the next is opened
        if source.mtp_file is not None:
            for name, tensor in load_file(source.mtp_file).items():
                writer.add(name, tensor)
        writer.close()
        _write_config_and_assets(Path(tmp), source, family)
        copy_tokenizer(tokenizer, Path(tmp))
    bar.close()
    if lora_adapter_dir is not None:
        adapters.write_peft_adapter(source, lora_adapter_dir, overwrite, adapters.hf_base_name(source, hf_config_dir))
    return Path(save_dir)


def _write_stage(states: list[dict[str, torch.Tensor]], source: MegatronSource, chunk: ck.Chunk,
                 writer: ShardedSafetensorsWriter, bar: tqdm) -> None:
    """Fill one chunk's HF tensors straight from its TP slices and hand them to the writer in HF order."""
    arch, tp = source.arch, source.par.tp
    shards = {name: [state[local] for state in states] for name, local in ck.chunk_names(arch, chunk).items()}
    shapes = hfm.hf_param_shapes(arch)
    for vocab in (hfm.EMBEDDING, hfm.OUTPUT):
        shapes[vocab[0]] = (source.hf_vocab, arch.hidden_size)

    def add(names: list[str], hf_names: list[str]) -> None:
        pieces = tp_layout.hf_pieces(arch, tp, names)
        for hf_name in hf_names:
            writer.add(hf_name, _hf_tensor(pieces[hf_name], shapes[hf_name], hfm.tensor_dtype(hf_name, source.dtype),
                                           shards, tp))

    if chunk.first:
        add([hfm.EMBEDDING[1]], [hfm.EMBEDDING[0]])
        for hf_name, name in hfm.vision_names(arch):
            add([name], [hf_name])
    for local in range(chunk.num_layers):
        index = chunk.first_layer + local
        layer = arch.layer_arch(index)
        add([hfm.mcore_layer_prefix(index) + s for s in sharding.layer_param_shapes(layer)],
            [hfm.hf_layer_prefix(index) + n for n in hfm.hf_layer_names(layer)])
        bar.update(1)
    if chunk.last:
        add([hfm.FINAL_NORM[1]], [hfm.FINAL_NORM[0]])
        if arch.has_output_layer:
            add([hfm.OUTPUT[1]], [hfm.OUTPUT[0]])
        if arch.has_score_head:
            add([hfm.SCORE[1]], [hfm.SCORE[0]])


def _hf_tensor(pieces: list[tuple[str, int, tp_layout.Piece]], shape: tuple[int, ...], dtype: torch.dtype,
               shards: dict[str, list[torch.Tensor]], tp: int) -> torch.Tensor:
    """One HF tensor, filled once from the TP slices (the vocabulary cut to the HF model's rows).

    From a TP=1 checkpoint, an HF tensor that is rows of one Megatron tensor as stored is taken
    as those mapped rows, as joining a single slice always did. At TP > 1 every tensor is filled,
    even a replicated norm: a view would keep its rank file mapped, with every page read from it,
    until the output shard is written.
    """
    rows = shape[0]
    pieces = [(name, rank, replace(piece, count=min(piece.count, rows - piece.hf_start)))
              for name, rank, piece in pieces if piece.hf_start < rows]
    if tp == 1 and len(pieces) == 1:
        name, rank, piece = pieces[0]
        if piece.col_block is None and piece.count == rows:
            return shards[name][rank][piece.start:piece.start + rows]
    return tp_layout.fill_hf_tensor(torch.empty(shape, dtype=dtype), pieces, shards, tp)


def _write_config_and_assets(tmp: Path, source: MegatronSource, family: str) -> None:
    """config.json (the original one if known, with the stored dtype), plus tokenizer files etc."""
    if source.hf_config is not None:
        config = dict(source.hf_config)
    else:
        config = hfm.hf_config_from_arch(source.arch, family, source.dtype)
    if source.assets_dir is not None:
        copy_assets(source.assets_dir, tmp, skip=("config.json",))
    config["dtype" if "dtype" in config else "torch_dtype"] = str(source.dtype).removeprefix("torch.")
    if config.get(hfm.MTP_KEY) and source.mtp_file is None:
        config[hfm.MTP_KEY] = 0  # a trained checkpoint, or one converted without them: say they are not there
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if not (tmp / "generation_config.json").is_file():
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
