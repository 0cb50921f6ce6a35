"""A LoRA run's Megatron checkpoint out to HF: merged weights for mcore2hf, and a PEFT adapter folder.

A rank file of a LoRA run records `lora` (mindrl/checkpoint/training.py). Its model holds the base weights and the
adapters, or with `adapters_only` the adapters alone, trained on a base whose digest per rank file it keeps. The
merged export is W + (alpha / r)·B·A per TP shard (lora.merge_state_dict: local to each shard), after which the
ordinary mapping writes the HF model; an adapters-only checkpoint takes its base from --lora-base or from the
`initial_weights` its trainer recorded, and a base whose digest differs is refused, since merging adapters into
weights they were not trained on gives a model nobody trained. The adapter folder is what `peft.PeftModel`
loads on top of the base HF model: whole adapters (joined over TP, PP and EP) under PEFT's names.

megatron-core (under mindrl.models.lora) is imported here only, when a checkpoint has adapters.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mindrl.checkpoint import chunks as ck
from mindrl.checkpoint import megatron as mg
from mindrl.checkpoint.atomic import atomic_directory
from mindrl.ckpt_convert.megatron_source import MegatronSource, open_megatron
from mindrl.config import ConfigError
from mindrl.models import hf_mapping as hfm
from mindrl.models import lora, sharding

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
#: PEFT's prefix of a causal LM's modules inside a PeftModel
PEFT_PREFIX = "base_model.model."


def open_base(source: MegatronSource, lora_base: str | Path | None = None) -> MegatronSource | None:
    """The base an adapters-only checkpoint was trained on (`lora_base`, else its recorded `initial_weights`),
    checked: same model and layout, and on every rank file the digest the run recorded. None for a checkpoint
    that holds its own base weights. Raises one sentence before anything is written."""
    if not source.adapters_only:
        if lora_base is not None:
            raise ConfigError(f"--lora-base applies to an adapters-only LoRA checkpoint (lora_ckpt_filter), but "
                              f"{source.root} holds its base weights itself; remove --lora-base.")
        return None
    root = lora_base or source.initial_weights
    if root is None:
        raise ConfigError(f"{source.root} holds LoRA adapters without their base weights and records no base (its "
                          f"run started from random weights or was not saved by a trainer); pass --lora-base "
                          f"<Megatron checkpoint they were trained on>.")
    base = open_megatron(root, model_type_hf=source.model_type_hf)
    if base.adapters_only:
        raise ConfigError(f"the LoRA base {root} is itself an adapters-only checkpoint; pass the Megatron "
                          f"checkpoint with the base weights instead.")
    mine, theirs = _layout(source), _layout(base)
    if mine != theirs:
        raise ConfigError(f"the LoRA base {root} is laid out as {theirs} but the adapters of {source.root} as "
                          f"{mine}; re-shard the base to that layout (cli/convert_ckpt.py mg -> mg) and pass it.")
    _check_digests(source, base, root)
    return base


def _layout(source: MegatronSource) -> str:
    counts = ",".join(str(c.num_layers) for c in source.chunks)
    return f"TP={source.par.tp} PP={source.par.pp} EP={source.par.ep} (layers {counts})"


def _check_digests(source: MegatronSource, base: MegatronSource, root: str | Path) -> None:
    for tp_rank, pp_rank, ep_rank in _ranks(source):
        adapters = mg.read_rank(source.rank_path(tp_rank, pp_rank, ep_rank))
        recorded = adapters["lora"]["base_digest"]
        stage = base_stage(mg.read_rank(base.rank_path(tp_rank, pp_rank, ep_rank)), "model", source.dtype)
        found = lora.weights_digest(stage)
        if found != recorded:
            raise ConfigError(f"the LoRA base {root} is not the one the adapters of {source.root} were trained on "
                              f"(TP {tp_rank} PP {pp_rank} EP {ep_rank}: digest {found}, recorded {recorded}); "
                              f"pass the run's initial weights, unchanged, as --lora-base.")


def _ranks(source: MegatronSource) -> list[tuple[int, int, int]]:
    return [(t, p, e) for p in range(source.par.pp) for t in range(source.par.tp) for e in range(source.par.ep)]


def base_stage(contents: dict, key: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A rank file's chunk as a LoRA actor's base on that rank held it: a LoRA checkpoint's adapters merged (as
    the actor's start merged them), in the actor's dtype (the adapters')."""
    model = contents[key]
    record = contents.get("lora")
    if record:
        model = lora.merge_state_dict(model, record["alpha"] / record["r"])
    return {name: tensor.to(hfm.tensor_dtype(name, dtype)) for name, tensor in model.items()}


def merged_chunk(source: MegatronSource, base: MegatronSource | None, chunk: ck.Chunk) -> list[dict[str, torch.Tensor]]:
    """The chunk on every TP rank with its adapters merged, under the EP=1 names (MegatronSource.load_chunk's
    form): one merged copy of the chunk is held at a time."""
    scale = source.lora["alpha"] / source.lora["r"]
    out = []
    for tp_rank in range(source.par.tp):
        per_ep = []
        for ep_rank in range(source.par.ep):
            own = mg.read_rank(source.rank_path(tp_rank, chunk.pp_rank, ep_rank))[chunk.key]
            if base is not None:
                own = {**base_stage(mg.read_rank(base.rank_path(tp_rank, chunk.pp_rank, ep_rank)), chunk.key,
                                    source.dtype), **own}
            per_ep.append(lora.merge_state_dict(own, scale))
        out.append(ck.merge_expert_ranks(source.arch, source.par, chunk, per_ep))
    return out


def whole_adapters(source: MegatronSource) -> dict[str, torch.Tensor]:
    """Every adapter tensor of the model under its full Megatron name, joined over TP, PP and EP ranks."""
    arch, par = source.arch, source.par
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for chunk in source.chunks:
        for tp_rank in range(par.tp):
            for ep_rank in range(par.ep):
                experts = sharding.expert_range(arch, par, ep_rank) if par.ep > 1 else None
                full = {local: name for name, local in ck.chunk_names(arch, chunk, experts).items()}
                model = mg.read_rank(source.rank_path(tp_rank, chunk.pp_rank, ep_rank))[chunk.key]
                for name, tensor in model.items():
                    if lora.is_adapter(name):
                        module, _, half = name.rpartition(f".{lora.ADAPTER}.")
                        whole = full[f"{module}.weight"].removesuffix(".weight") + f".{lora.ADAPTER}.{half}"
                        shards.setdefault(whole, {})[tp_rank] = tensor
    return {name: lora.merge_adapter_shards(name, [by_rank[t] for t in range(par.tp)], arch.swiglu)
            for name, by_rank in shards.items()}


def peft_tensors(source: MegatronSource) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names on the HF model (`base_model.model.model.layers.0.self_attn.q_proj.lora_A
    .weight`), a fused layer's cut into its HF parts by hf_mapping.lora_to_hf_layer."""
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in whole_adapters(source).items():
        index = int(name.split(".")[2])
        by_layer.setdefault(index, {})[name.removeprefix(hfm.mcore_layer_prefix(index))] = tensor
    # cloned: a fused layer's parts share its A, and safetensors stores no tensor twice
    return {f"{PEFT_PREFIX}{hfm.hf_layer_prefix(index)}{hf_name}": tensor.clone()
            for index, adapters in sorted(by_layer.items())
            for hf_name, tensor in hfm.lora_to_hf_layer(adapters, source.arch.layer_arch(index)).items()}


def peft_cannot_place(source: MegatronSource) -> str | None:
    """Why PEFT's LoRA modules on the HF model could not hold this checkpoint's adapters, or None. Written anyway,
    such a folder would load without error and leave the adapters out (PEFT skips what it cannot place)."""
    if source.arch.vision is not None:
        return "a vision-language model's language layers sit under model.language_model there, which the folder does "\
               "not map"
    if source.arch.is_moe and {"linear_fc1", "linear_fc2"} & set(source.lora["target_modules"]):
        return "transformers fuses a mixture of experts' experts into 3-D parameters, which no LoRA module wraps"
    return None


def write_peft_adapter(source: MegatronSource, save_dir: str | Path, overwrite: bool = False,
                       base_model: str | None = None) -> Path:
    """`save_dir` as PEFT saves a LoRA adapter (adapter_config.json, adapter_model.safetensors), for
    `PeftModel.from_pretrained(base HF model, save_dir)`; `base_model` is what its config names as the base.
    mcore_to_hf checks, before writing anything, that `source` has adapters PEFT can place."""
    tensors = peft_tensors(source)
    modules = sorted({name.rsplit(".", 3)[-3] for name in tensors})  # ….q_proj.lora_A.weight → q_proj
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": source.lora["r"],
              "lora_alpha": source.lora["alpha"], "target_modules": modules, "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True, "modules_to_save": None,
              "base_model_name_or_path": base_model}
    with atomic_directory(save_dir, overwrite) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Path(save_dir)


def hf_base_name(source: MegatronSource, hf_config_dir: str | Path | None) -> str | None:
    """The base HF model an adapter folder names: --hf-config-dir (the original HF model), else the stored HF
    config's `_name_or_path`, else nothing known."""
    if hf_config_dir is not None:
        return str(hf_config_dir)
    return (source.hf_config or {}).get("_name_or_path") or None
