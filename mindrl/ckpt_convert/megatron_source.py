"""A Megatron checkpoint opened for conversion (mg → hf, mg → mg).

Everything is decided and checked before the first byte is written: the architecture (mindrl's
exact one; else Megatron-LM's / MindSpeed-LLM's args; else --hf-config-dir with
--model-type-hf), the layout, every rank file's tensor names and shapes, and that the last
stage's copy of a tied embedding still equals the embedding. Rank files are only memory-mapped
here, so the checks cost their pickles, not their weights. Afterwards the weights are read one
model chunk (all its TP ranks) at a time.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindrl.checkpoint import chunks as ck
from mindrl.checkpoint import megatron as mg
from mindrl.checkpoint import megatron_args
from mindrl.ckpt_convert.assets import ASSETS_DIR
from mindrl.config import ConfigError, ModelArch, ParallelConfig, validate_parallel
from mindrl.models import arch_fields as af
from mindrl.models import hf_mapping as hfm

_RANK_DIR = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?$")
# --model-type-hf for each HF model_type, when only config.json names the family.
_FROM_HF_MODEL_TYPE = {model_type: "llama3" if model_type == "llama" else model_type
                       for model_type in hfm.HF_ARCHITECTURES}


@dataclass
class MegatronSource:
    root: Path
    iteration: int | str
    arch: ModelArch
    par: ParallelConfig
    chunks: list[ck.Chunk]
    dtype: torch.dtype
    #: the model's HF config.json (--hf-config-dir's, or the one stored at conversion), if known
    hf_config: dict[str, Any] | None
    model_type_hf: str | None
    #: where the HF side files (tokenizer, generation config) come from, if anywhere
    assets_dir: Path | None
    #: a LoRA run's record (r, alpha, target_modules, adapters_only, base_digest) from its first rank file, else None
    lora: dict[str, Any] | None = None
    #: the Megatron root the run started from (a trainer's `initial_weights`), where the checkpoint records one
    initial_weights: str | None = None

    @property
    def mtp_file(self) -> Path | None:
        """The multi-token-prediction layers hf2mcore carried beside the checkpoint's HF files, if any."""
        path = self.assets_dir / hfm.MTP_FILE if self.assets_dir is not None else None
        return path if path is not None and path.is_file() else None

    @property
    def adapters_only(self) -> bool:
        """A LoRA checkpoint holding its adapters without the base they were trained on (lora_ckpt_filter)."""
        return bool(self.lora and self.lora["adapters_only"])

    @property
    def hf_vocab(self) -> int:
        """Vocabulary rows of the HF model: its config's, else the architecture's."""
        return int(hfm.text_config_of(self.hf_config)["vocab_size"]) if self.hf_config else self.arch.padded_vocab_size

    def load_chunk(self, chunk: ck.Chunk) -> list[dict[str, torch.Tensor]]:
        """The chunk's state dict on every TP rank, memory-mapped; with EP > 1 joined from the expert-parallel
        ranks' files under the EP=1 names."""
        return [ck.merge_expert_ranks(self.arch, self.par, chunk,
                                      [mg.read_rank(self.rank_path(t, chunk.pp_rank, e))[chunk.key]
                                       for e in range(self.par.ep)])
                for t in range(self.par.tp)]

    def rank_path(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> Path:
        return mg.rank_file(self.root, self.iteration, tp_rank, pp_rank, self.par.pp, ep_rank, self.par.ep)


def open_megatron(load_dir: str | Path, hf_config_dir: str | Path | None = None,
                  model_type_hf: str | None = None) -> MegatronSource:
    """Open and check a checkpoint; raises one sentence (ConfigError / OSError) on any problem."""
    root = Path(load_dir)
    iteration = mg.read_tracker(root)
    folder = mg.check_format(root, iteration)
    args = mg.load_args(root, iteration)
    hf_config, assets_dir = _hf_side(root, args, hf_config_dir)
    if model_type_hf is None:
        model_type_hf = getattr(args, "model_type_hf", None) if megatron_args.is_mindrl(args) else None
    if model_type_hf is None and hf_config is not None:
        model_type_hf = _FROM_HF_MODEL_TYPE.get(hf_config.get("model_type"))
        if model_type_hf is None:
            raise ConfigError(f"config.json of --hf-config-dir has model_type {hf_config.get('model_type')!r}, "
                              f"which mindrl does not convert ({', '.join(_FROM_HF_MODEL_TYPE)}).")
    name = root.resolve().name or "checkpoint"
    text = hfm.text_config_of(hf_config or {})
    hf_vocab = int(text["vocab_size"]) if "vocab_size" in text else None
    try:
        arch = mg.arch_of(args, name, hf_vocab)
        par = mg.parallel_of(args)
        virtual = megatron_args.virtual_stages(args)
    except megatron_args.ArgsIncomplete:
        if hf_config is None or model_type_hf is None:
            raise
        arch = hfm.arch_from_hf_config(hf_config, model_type_hf, name=name, orm=None)
        par, virtual = _layout_from_files(root, folder, iteration)
    if hf_config_dir is not None:
        _check_hf_config_fits(root, arch, par, hf_config, model_type_hf)
    validate_parallel(arch, par)
    layout = ck.chunk_layout(arch, par, virtual)
    dtype, lora, extra = _check_rank_files(root, iteration, arch, par, layout)
    return MegatronSource(root, iteration, arch, par, layout, dtype, hf_config, model_type_hf, assets_dir, lora,
                          (extra or {}).get("initial_weights"))


def _hf_side(root: Path, args: Any, hf_config_dir: str | Path | None) -> tuple[dict | None, Path | None]:
    """The HF config.json and the folder of HF side files: --hf-config-dir, else what conversion stored."""
    if hf_config_dir is not None:
        path = Path(hf_config_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"--hf-config-dir {hf_config_dir} has no config.json.")
        return json.loads(path.read_text()), Path(hf_config_dir)
    stored = root / ASSETS_DIR
    config = getattr(args, "hf_config", None) if megatron_args.is_mindrl(args) else None
    return (dict(config) if config else None), (stored if stored.is_dir() else None)


def _check_hf_config_fits(root: Path, arch: ModelArch, par: ParallelConfig, config: dict,
                          model_type_hf: str) -> None:
    hf_arch = hfm.arch_from_hf_config(config, model_type_hf, name="the HF config", orm=None)
    diffs = af.arch_differences(arch, hf_arch, par.tp, structural_only=True, label="HF config")
    if diffs:
        raise ConfigError(f"--hf-config-dir describes another model than checkpoint {root}: "
                          + ", ".join(diffs[:4]) + "; pass the --hf-config-dir of this model.")
    rows = arch.vocab_size_for(1)
    if hf_arch.padded_vocab_size > rows:
        raise ConfigError(f"--hf-config-dir's vocab_size={hf_arch.padded_vocab_size} exceeds the {rows} embedding "
                          f"rows of checkpoint {root}; pass the --hf-config-dir of this model.")


def _layout_from_files(root: Path, folder: Path, iteration: int | str) -> tuple[ParallelConfig, int]:
    """TP and PP from the rank directories, layer counts and virtual stages from the files,
    for a checkpoint whose args say nothing."""
    found = [m for m in (_RANK_DIR.match(p.name) for p in folder.iterdir() if p.is_dir()) if m]
    if not found:
        raise FileNotFoundError(f"{folder} has no mp_rank_TT or mp_rank_TT_PPP directories; it is not a "
                                f"per-rank Megatron checkpoint (expert-parallel ones are not converted).")
    tp = 1 + max(int(m.group(1)) for m in found)
    pp = 1 + max(int(m.group(2) or 0) for m in found)
    counts, virtual = [], 1
    for pp_rank in range(pp):
        state = mg.read_rank(mg.existing_rank_file(root, iteration, 0, pp_rank, pp))
        keys = ck.model_keys(state)
        virtual = len(keys)
        counts.append(sum(len({n.split(".")[2] for n in state[k] if n.startswith("decoder.layers.")})
                          for k in keys))
    layers = ",".join(map(str, counts)) if virtual == 1 and len(set(counts)) > 1 else None
    return ParallelConfig(tp, pp, num_layer_list=layers), virtual


def _check_rank_files(root: Path, iteration: int | str, arch: ModelArch, par: ParallelConfig,
                      layout: list[ck.Chunk]) -> tuple[torch.dtype, dict | None, dict | None]:
    """Every rank file holds exactly the tensors of its chunks, in their shapes (a LoRA run's adapters beside
    them; an adapters-only file's base is checked where it is read, see lora_export); the tied copy equals the
    embedding. Returns the weights' dtype, the first file's LoRA record and its extra."""
    expected = {(chunk, e): ck.expected_shapes(arch, par, chunk, e) for chunk in layout for e in range(par.ep)}
    dtype, first = None, None
    for tp_rank, ep_rank in itertools.product(range(par.tp), range(par.ep)):
        embedding = None
        for pp_rank in range(par.pp):
            path = mg.existing_rank_file(root, iteration, tp_rank, pp_rank, par.pp, ep_rank, par.ep)
            state = mg.read_rank(path)
            where = path.relative_to(root)
            first = first or {"lora": state.get("lora"), "extra": state.get("extra")}
            record = _same_lora(root, where, first.get("lora"), state.get("lora"))
            for chunk in (c for c in layout if c.pp_rank == pp_rank):
                if chunk.key not in state:
                    raise ConfigError(f"{where} has no {chunk.key!r} model chunk, though the checkpoint's args "
                                      f"describe one; its args do not match its files.")
                model = state[chunk.key]
                if record:
                    model = check_adapters(where, chunk.key, model, expected[(chunk, ep_rank)], record["r"])
                dtype = dtype or next(iter(state[chunk.key].values())).dtype  # an adapters-only one: theirs
                if record and record["adapters_only"]:
                    continue
                _check_names_and_shapes(where, chunk.key, model, expected[(chunk, ep_rank)])
                if chunk.first:
                    embedding = model[hfm.EMBEDDING[1]]
                if ck.holds_tied_copy(arch, par, chunk):
                    _check_tied_copy(root, tp_rank, embedding, model[hfm.OUTPUT[1]])
            del state
    return dtype, first.get("lora"), first.get("extra")


def _same_lora(root: Path, where: Path, first: dict | None, record: dict | None) -> dict | None:
    """Every rank file of a checkpoint tells the same LoRA story (its digest, of its own base, aside)."""
    def settings(rec: dict | None) -> tuple | None:
        return rec and (rec["r"], rec["alpha"], sorted(rec["target_modules"]), rec["adapters_only"])

    if settings(first) != settings(record):
        raise ConfigError(f"checkpoint {root}: {where} records LoRA settings {settings(record)} but the first rank "
                          f"file {settings(first)}; its files come from different runs.")
    return record


def check_adapters(where: Path, key: str, model: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                   r: int) -> dict[str, torch.Tensor]:
    """Each LoRA tensor sits on a weight the architecture has, in the rank-r shape of that weight's shard
    (A [r, in], B [out, r]); returns the chunk's other tensors, which are checked as any checkpoint's are."""
    base = {}
    for name, tensor in model.items():
        module, adapter, half = name.rpartition(".adapter.")
        if not adapter:
            base[name] = tensor
            continue
        weight = expected.get(f"{module}.weight")
        shape = None if weight is None or half not in ("lora_A", "lora_B") else \
            (r, weight[1]) if half == "lora_A" else (weight[0], r)
        if shape is None or tuple(tensor.shape) != shape:
            raise ConfigError(f"{where} [{key}]: LoRA tensor {name} of shape {tuple(tensor.shape)} fits no "
                              f"{'weight' if weight is None else f'rank-{r} adapter of its {weight} weight'}; "
                              f"the checkpoint is damaged or its args do not match its weights.")
    return base


def _check_names_and_shapes(where: Path, key: str, model: dict[str, torch.Tensor],
                            expected: dict[str, tuple[int, ...]]) -> None:
    missing = [n for n in expected if n not in model]
    if missing:
        raise ConfigError(f"{where} [{key}] lacks {len(missing)} of the tensors its args describe, e.g. "
                          f"{missing[0]}; the checkpoint is incomplete or its args do not match its weights.")
    unexpected = [n for n in model if n not in expected]
    if unexpected:
        raise ConfigError(f"{where} [{key}] holds {len(unexpected)} tensors the architecture does not have, "
                          f"e.g. {unexpected[0]}; nothing is dropped silently, so check the checkpoint's args.")
    for name, shape in expected.items():
        if tuple(model[name].shape) != shape:
            raise ConfigError(f"{where} [{key}]: {name} has shape {tuple(model[name].shape)} but the "
                              f"architecture needs {shape}; the checkpoint's args do not match its weights.")


def _check_tied_copy(root: Path, tp_rank: int, embedding: torch.Tensor, copy: torch.Tensor) -> None:
    """Megatron keeps the two in sync; a difference means drift or damage, and converting would
    silently pick one of them."""
    if torch.equal(embedding, copy):
        return
    worst = max((embedding[i:i + 4096].float() - copy[i:i + 4096].float()).abs().max().item()
                for i in range(0, embedding.shape[0], 4096))
    raise ConfigError(f"checkpoint {root}: the last pipeline stage's output_layer.weight (Megatron's copy of the "
                      f"tied embedding) differs from embedding.word_embeddings.weight on TP rank {tp_rank} by up "
                      f"to {worst:.3g}, so the copies drifted or a file is damaged; nothing was converted.")
