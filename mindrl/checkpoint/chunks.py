"""What the model chunks of a Megatron rank file hold, and under which names.

A rank file holds one model chunk under `model`, or with a virtual pipeline one per
virtual stage under `model0`, `model1`, ... Chunk (pp_rank, v) holds the layers Megatron's
get_transformer_layer_offset gives it: v × (layers / vpp) + pp_rank × (layers / (pp × vpp))
onward, numbered from 0 inside the chunk. The embedding is in the first chunk, the final
norm and output layer in the last.

Megatron-LM's default Transformer Engine layer spec fuses each pre-attention and pre-MLP
norm into the following linear layer and adds `_extra_state` entries (kernel metadata, no
weights); normalize_model maps those names onto the local spec's, so one layout serves
every writer. It does the same for the grouped-GEMM experts Megatron-LM and MindSpeed-LLM write
with `--moe-grouped-gemm`: Transformer Engine's GroupedLinear keeps expert i's matrices as
`experts.linear_fc1.weight<i>`, and the legacy GroupedMLP keeps all of a rank's experts in
`experts.weight1` / `experts.weight2`; both become SequentialMLP's `experts.local_experts.<i>.`.
Multi-latent attention's tensors, which MindSpeed-LLM and the Transformer Engine spec name and cut otherwise,
are mapped by mla_names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from mindrl.checkpoint import mla_names
from mindrl.config import ConfigError, ModelArch, ParallelConfig
from mindrl.models import sharding

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EMBEDDING, _OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
_MODEL_KEY = re.compile(r"^model(\d*)$")
# Transformer Engine's fused names → the local spec's.
_TE_RENAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_TE_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_LEGACY_GROUPED = {"mlp.experts.weight1": "linear_fc1", "mlp.experts.weight2": "linear_fc2"}


@dataclass(frozen=True)
class Chunk:
    pp_rank: int
    key: str  # "model", or "model{v}" with a virtual pipeline
    first_layer: int
    num_layers: int
    first: bool  # holds the embedding
    last: bool  # holds the final norm and the output layer


def chunk_layout(arch: ModelArch, par: ParallelConfig, virtual_stages: int = 1) -> list[Chunk]:
    """Every model chunk, in the order of the layers it holds."""
    if virtual_stages == 1:
        firsts, counts = par.first_layer_of_stages(arch), par.layers_per_stage(arch)
        return [Chunk(p, "model", firsts[p], counts[p], p == 0, p == par.pp - 1) for p in range(par.pp)]
    if par.num_layer_list or arch.num_layers % (par.pp * virtual_stages):
        raise ConfigError(f"a virtual pipeline of {virtual_stages} stages per rank needs num_layers="
                          f"{arch.num_layers} to split evenly over {par.pp}×{virtual_stages} chunks; "
                          f"mindrl reads only even virtual-pipeline splits.")
    per_chunk = arch.num_layers // (par.pp * virtual_stages)
    return [Chunk(p, f"model{v}", v * par.pp * per_chunk + p * per_chunk, per_chunk, v == 0 and p == 0,
                  v == virtual_stages - 1 and p == par.pp - 1)
            for v in range(virtual_stages) for p in range(par.pp)]


def chunk_names(arch: ModelArch, chunk: Chunk, experts: range | None = None) -> dict[str, str]:
    """Full (TP=1, PP=1) name → name inside the chunk, of every parameter the chunk holds; of the routed
    experts only those in `experts` (an expert-parallel rank's, numbered from 0 there) if given."""
    return sharding.range_names(arch, chunk.first_layer, chunk.num_layers, chunk.first, chunk.last, experts)


def merge_expert_ranks(arch: ModelArch, par: ParallelConfig, chunk: Chunk,
                       states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One TP rank's chunk from its expert-parallel ranks' files: under the names of the EP=1 chunk (experts
    numbered over all of them), the layers around the experts from the first file."""
    if len(states) == 1:
        return states[0]
    merged: dict[str, torch.Tensor] = {}
    full = chunk_names(arch, chunk)
    for ep_rank, state in enumerate(states):
        for name, local in chunk_names(arch, chunk, sharding.expert_range(arch, par, ep_rank)).items():
            if ep_rank == 0 or sharding.expert_of(name) is not None:
                merged[full[name]] = state[local]
    return merged


def holds_tied_copy(arch: ModelArch, par: ParallelConfig, chunk: Chunk) -> bool:
    """Whether the chunk carries Megatron's copy of a tied embedding as `output_layer.weight`."""
    return arch.tied_embeddings and par.pp > 1 and chunk.last


def expected_shapes(arch: ModelArch, par: ParallelConfig, chunk: Chunk, ep_rank: int | None = None,
                    ) -> dict[str, tuple[int, ...]]:
    """Local name → shape on one TP rank (every rank holds the same shapes); with `ep_rank`, of the file of that
    expert-parallel rank (its experts alone)."""
    experts = None if ep_rank is None else sharding.expert_range(arch, par, ep_rank)
    names = dict(chunk_names(arch, chunk, experts))
    if holds_tied_copy(arch, par, chunk):
        names[_OUTPUT] = _OUTPUT
    return {local: sharding.shard_shape(name, arch, par.tp) for name, local in names.items()}


def model_keys(state: dict[str, Any]) -> list[str]:
    """The model chunk keys of a rank file: ["model"] or ["model0", "model1", ...]."""
    return sorted((k for k in state if isinstance(k, str) and _MODEL_KEY.match(k)),
                  key=lambda k: int(k[5:] or -1))


def normalize_model(model: Any, where: str, local_experts: int | None = None,
                    mla: mla_names.MLACut | None = None) -> dict[str, torch.Tensor]:
    """A chunk's state dict in the local spec's names, without `_extra_state`; one sentence if a
    value is not a tensor or the chunk is a legacy (non-mcore) model. `local_experts` (experts per
    EP rank) is needed only to split legacy grouped-GEMM weights, `mla` only for multi-latent attention."""
    if not isinstance(model, dict):
        raise ConfigError(f"{where} holds a {type(model).__name__} where the model state dict should be.")
    if "language_model" in model or any(str(k).startswith("language_model.") for k in model):
        raise ConfigError(f"{where} is a legacy (non-mcore) Megatron model; mindrl reads megatron-core "
                          f"(GPTModel) checkpoints only, so convert it to mcore with Megatron-LM first.")
    out = {}
    for name, value in model.items():
        if name.endswith("_extra_state"):
            continue
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"{where}: {name} is a {getattr(value, 'pickled_as', type(value).__name__)}, "
                              f"not a tensor; the file is damaged or from an unsupported writer.")
        match = _LAYER.match(name)
        if match is None:
            out[name] = value
            continue
        layer, rest = f"decoder.layers.{match.group(1)}.", match.group(2)
        grouped = _TE_GROUPED.match(rest)
        if rest in _TE_RENAMES:
            out[layer + _TE_RENAMES[rest]] = value
        elif grouped:
            out[f"{layer}mlp.experts.local_experts.{grouped.group(3)}.{grouped.group(1)}.{grouped.group(2)}"] = value
        elif rest in _LEGACY_GROUPED:
            out.update(_split_grouped(layer, rest, value, local_experts, where))
        else:
            out[name] = value
    return out if mla is None else mla_names.to_local_spec(out, mla, where)


def _split_grouped(layer: str, rest: str, value: torch.Tensor, local_experts: int | None,
                   where: str) -> dict[str, torch.Tensor]:
    """GroupedMLP lays its experts' transposed matrices end to end in memory: weight1 (hidden × experts·F)
    is read as experts × hidden × F, weight2 (experts·F × hidden) as experts × F × hidden (megatron-core's
    GroupedMLP.forward views them so); transposed back they are SequentialMLP's per-expert weights."""
    if not local_experts:
        raise ConfigError(f"{where}: {layer + rest} holds grouped-GEMM expert weights, but the checkpoint's args do "
                          f"not name num_experts, so they cannot be split per expert; convert from a checkpoint "
                          f"saved with its args.")
    linear = _LEGACY_GROUPED[rest]
    fc1 = linear == "linear_fc1"
    if value.dim() != 2 or value.numel() % (local_experts * (hidden := value.shape[0 if fc1 else 1])):
        raise ConfigError(f"{where}: {layer + rest} has shape {tuple(value.shape)}, which does not split into "
                          f"{local_experts} experts; the args' num_experts / expert_model_parallel_size do not "
                          f"match the weights.")
    matrices = value.reshape(local_experts, hidden, -1) if fc1 else value.reshape(local_experts, -1, hidden)
    return {f"{layer}mlp.experts.local_experts.{e}.{linear}.weight": matrix.t().contiguous()
            for e, matrix in enumerate(matrices)}
