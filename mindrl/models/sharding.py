"""Megatron-side weight layout: which parameters a GPTModel has, and how TP/PP cut them.

A "full" state dict uses the names of a TP=1, PP=1 model (global layer numbers). A
"stage" state dict is what one (tp_rank, pp_rank) GPTModel holds (local layer numbers,
its tensor slice, embedding only on the first stage, final norm and output layer (or a
reward model's rm_head) only on the last). The converter, the resharder and the tests all cut and join weights here.

Cuts follow megatron-core's own partitioning:
- column-parallel (output dim 0): embedding rows (vocab), output layer rows, linear_qkv
  (whole query groups, which Megatron stores contiguously per group), linear_fc1 — whose
  gate and up halves are cut separately so each rank holds [gate_r; up_r]; multi-latent attention's
  projections (the up projections by heads, the down projections by rows of the latent);
- row-parallel (input dim 1): linear_proj, linear_fc2;
- everything else (norms, row-parallel biases, a reward model's rm_head) is replicated.
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch

from mindrl.config import ModelArch, ParallelConfig
from mindrl.models.vision import vision_param_shapes

#: the vision tower's parameters (a vision-language model's), in the first stage and replicated over TP
VISION_PREFIX = "vision_model."

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")
_EXPERT_MLP = re.compile(r"^mlp\.(experts\.local_experts\.\d+|shared_experts)\.")

_COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
           "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
           # multi-latent attention: the up projections by heads, the down projections as megatron-core's local spec
           # cuts them (each rank computes a slice of the latent, which is gathered)
           "self_attention.linear_q_proj.weight", "self_attention.linear_q_down_proj.weight",
           "self_attention.linear_q_up_proj.weight", "self_attention.linear_kv_down_proj.weight",
           "self_attention.linear_kv_up_proj.weight")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def layer_param_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's parameters at TP=1, keyed by name inside the layer (of an MoE model with dense
    layers first, pass the layer's own architecture: `arch.layer_arch(index)`)."""
    h, hd = arch.hidden_size, arch.head_dim
    qkv_rows = (arch.num_attention_heads + 2 * arch.query_groups) * hd
    fc1_rows = arch.ffn_hidden_size * (2 if arch.swiglu else 1)
    bias = not arch.disable_bias_linear
    shapes: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,)}
    if arch.multi_latent_attention:
        shapes.update(mla_param_shapes(arch))
    else:
        shapes["self_attention.linear_qkv.weight"] = (qkv_rows, h)
        if arch.add_qkv_bias or bias:
            shapes["self_attention.linear_qkv.bias"] = (qkv_rows,)
        if arch.qk_layernorm:
            shapes["self_attention.q_layernorm.weight"] = (hd,)
            shapes["self_attention.k_layernorm.weight"] = (hd,)
    shapes["self_attention.linear_proj.weight"] = (h, arch.num_attention_heads * arch.value_head_dim)
    if bias:
        shapes["self_attention.linear_proj.bias"] = (h,)
    shapes["pre_mlp_layernorm.weight"] = (h,)
    if arch.is_moe:
        shapes.update(_moe_param_shapes(arch))
    else:
        shapes["mlp.linear_fc1.weight"] = (fc1_rows, h)
        if bias:
            shapes["mlp.linear_fc1.bias"] = (fc1_rows,)
        shapes["mlp.linear_fc2.weight"] = (h, arch.ffn_hidden_size)
        if bias:
            shapes["mlp.linear_fc2.bias"] = (h,)
    if arch.normalization == "LayerNorm":
        shapes["input_layernorm.bias"] = (h,)
        shapes["pre_mlp_layernorm.bias"] = (h,)
    return shapes


def mla_param_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Multi-latent attention's projections and latent norms (models/mla.py), output projection aside."""
    h, heads, latent = arch.hidden_size, arch.num_attention_heads, arch.kv_lora_rank
    query = heads * arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if arch.q_lora_rank is None:
        shapes["self_attention.linear_q_proj.weight"] = (query, h)
    else:
        shapes["self_attention.linear_q_down_proj.weight"] = (arch.q_lora_rank, h)
        shapes["self_attention.linear_q_up_proj.weight"] = (query, arch.q_lora_rank)
        shapes["self_attention.q_layernorm.weight"] = (arch.q_lora_rank,)
    shapes["self_attention.linear_kv_down_proj.weight"] = (latent + arch.qk_pos_emb_head_dim, h)
    shapes["self_attention.linear_kv_up_proj.weight"] = (heads * (arch.qk_head_dim + arch.v_head_dim), latent)
    shapes["self_attention.kv_layernorm.weight"] = (latent,)
    return shapes


def _moe_param_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """An MoE layer's MLP parameters at EP=1 (experts numbered globally), in megatron-core's order."""
    h, ffn = arch.hidden_size, arch.expert_ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {"mlp.router.weight": (arch.num_experts, h)}
    if arch.moe_router_enable_expert_bias:
        shapes["mlp.router.expert_bias"] = (arch.num_experts,)
    for e in range(arch.num_experts):
        shapes[f"{expert_prefix(e)}linear_fc1.weight"] = (2 * ffn, h)
        shapes[f"{expert_prefix(e)}linear_fc2.weight"] = (h, ffn)
    shared = arch.moe_shared_expert_intermediate_size
    if shared:
        shapes["mlp.shared_experts.linear_fc1.weight"] = (2 * shared, h)
        shapes["mlp.shared_experts.linear_fc2.weight"] = (h, shared)
        if arch.moe_shared_expert_gate:
            shapes["mlp.shared_experts.gate_weight"] = (1, h)
    return shapes


def expert_prefix(expert: int) -> str:
    """Megatron's name of routed expert `expert` inside a layer (SequentialMLP)."""
    return f"mlp.experts.local_experts.{expert}."


def full_param_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every parameter of the TP=1, PP=1 model, in state-dict order."""
    return dict(_full_shapes(arch))


@lru_cache(maxsize=32)
def _full_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """full_param_shapes, built once per architecture: per-tensor lookups (shard_shape, range_names) run over every
    tensor of a model, and Qwen3-30B-A3B has 12.6 thousand (rebuilding the table per lookup cost 7 ms each)."""
    vocab = arch.vocab_size_for(1)
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (vocab, arch.hidden_size)}
    if arch.vision is not None:
        shapes.update({VISION_PREFIX + name: shape
                       for name, shape in vision_param_shapes(arch.vision, arch.hidden_size).items()})
    for i in range(arch.num_layers):
        shapes.update({f"decoder.layers.{i}.{k}": v for k, v in layer_param_shapes(arch.layer_arch(i)).items()})
    shapes["decoder.final_layernorm.weight"] = (arch.hidden_size,)
    if arch.normalization == "LayerNorm":
        shapes["decoder.final_layernorm.bias"] = (arch.hidden_size,)
    if arch.has_output_layer:
        shapes["output_layer.weight"] = (vocab, arch.hidden_size)
    if arch.has_score_head:
        shapes["rm_head.weight"] = (arch.num_labels, arch.hidden_size)
    return shapes


def _suffix(name: str) -> str:
    """The name inside its layer, an expert's or the shared expert's MLP named as the dense MLP (they are cut
    alike)."""
    match = _LAYER.match(name)
    return _EXPERT_MLP.sub("mlp.", match.group(2)) if match else name


def expert_of(name: str) -> int | None:
    """The routed expert a parameter name belongs to, or None."""
    match = _EXPERT.search(name)
    return int(match.group(1)) if match else None


def tp_split(name: str, tensor: torch.Tensor, tp: int, swiglu: bool = True) -> list[torch.Tensor]:
    """Cut one full tensor into its `tp` slices (contiguous copies)."""
    suffix = _suffix(name)
    if tp == 1:
        return [tensor]
    if suffix in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias") and swiglu:
        gate, up = tensor.chunk(2, dim=0)
        return [torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
    if suffix in _COLUMN or name in _VOCAB:
        return [t.clone() for t in tensor.chunk(tp, dim=0)]
    if suffix in _ROW:
        return [t.contiguous() for t in tensor.chunk(tp, dim=1)]
    return [tensor.clone() for _ in range(tp)]


def tp_merge(name: str, shards: list[torch.Tensor], swiglu: bool = True) -> torch.Tensor:
    """Join `tp` slices back into the full tensor (inverse of tp_split)."""
    suffix = _suffix(name)
    if len(shards) == 1:
        return shards[0]
    if suffix in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias") and swiglu:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if suffix in _COLUMN or name in _VOCAB:
        return torch.cat(shards, dim=0)
    if suffix in _ROW:
        return torch.cat(shards, dim=1)
    return shards[0]


def shard_shape(name: str, arch: ModelArch, tp: int) -> tuple[int, ...]:
    """The shape of one TP rank's slice of full-model tensor `name` (vocabulary rows padded for TP).

    Which dimensions are cut is learned by cutting a tiny probe with tp_split, so the rule is
    not written twice.
    """
    if name in _VOCAB:
        shape: tuple[int, ...] = (arch.vocab_size_for(tp), arch.hidden_size)
    else:
        shape = _full_shapes(arch)[name]
    probe = torch.empty((2 * tp,) * len(shape))
    cut = tp_split(name, probe, tp, arch.swiglu)[0].shape
    return tuple(n // tp if c < 2 * tp else n for n, c in zip(shape, cut, strict=True))


def pad_vocab(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Append zero rows so a vocab-sized tensor has `rows` rows (TP needs equal slices)."""
    if tensor.shape[0] >= rows:
        return tensor
    pad = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad], dim=0)


def split_full_tensor(name: str, tensor: torch.Tensor, arch: ModelArch, par: ParallelConfig,
                      ) -> list[torch.Tensor]:
    """One full-model tensor → its slice on each TP rank (vocab rows zero-padded first)."""
    if name in _VOCAB:
        tensor = pad_vocab(tensor, arch.vocab_size_for(par.tp))
    return tp_split(name, tensor, par.tp, arch.swiglu)


def vocab_rows(arch: ModelArch, par: ParallelConfig, tp_rank: int) -> tuple[int, int, int]:
    """Rows [start, stop) of the unpadded vocab that TP rank `tp_rank` holds, and how many
    zero rows of padding follow them (only the last ranks get padding)."""
    per_rank = arch.vocab_size_for(par.tp) // par.tp
    start = tp_rank * per_rank
    stop = min(start + per_rank, arch.vocab_size_for(1))
    return min(start, stop), stop, per_rank - max(stop - start, 0)


def merge_full_tensor(name: str, shards: list[torch.Tensor], arch: ModelArch) -> torch.Tensor:
    """TP slices → the full-model tensor (vocab padding for TP removed again)."""
    tensor = tp_merge(name, shards, arch.swiglu)
    return tensor[:arch.vocab_size_for(1)] if name in _VOCAB else tensor


def stage_names(arch: ModelArch, par: ParallelConfig, pp_rank: int, ep_rank: int | None = 0) -> dict[str, str]:
    """Full name → local name of every parameter that pipeline stage `pp_rank` holds on expert-parallel rank
    `ep_rank` (which holds num_experts / EP of the experts, numbered from 0 there); with `ep_rank` None, of
    the whole stage at EP=1 (every expert, numbered globally)."""
    return range_names(arch, par.first_layer_of_stages(arch)[pp_rank], par.layers_per_stage(arch)[pp_rank],
                       holds_embedding=pp_rank == 0, holds_head=pp_rank == par.pp - 1,
                       experts=None if ep_rank is None else expert_range(arch, par, ep_rank))


def expert_range(arch: ModelArch, par: ParallelConfig, ep_rank: int) -> range:
    """The global numbers of the routed experts on expert-parallel rank `ep_rank`."""
    per_rank = (arch.num_experts or 0) // par.ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def range_names(arch: ModelArch, first_layer: int, num_layers: int, holds_embedding: bool,
                holds_head: bool, experts: range | None = None) -> dict[str, str]:
    """Full name → local name of the parameters of a model piece holding layers
    [first_layer, first_layer + num_layers) (numbered from 0 inside it), the embedding if
    `holds_embedding`, the final norm and output layer if `holds_head`, and of the routed experts the
    ones in `experts` (all if None; numbered from 0 inside it)."""
    names: dict[str, str] = {}
    for name in _full_shapes(arch):
        match = _LAYER.match(name)
        if match:
            index, inner = int(match.group(1)), match.group(2)
            expert = expert_of(name)
            if expert is not None and experts is not None:
                if expert not in experts:
                    continue
                inner = inner.replace(expert_prefix(expert), expert_prefix(expert - experts.start), 1)
            if first_layer <= index < first_layer + num_layers:
                names[name] = f"decoder.layers.{index - first_layer}.{inner}"
        elif holds_embedding if name.startswith(("embedding.", VISION_PREFIX)) else holds_head:
            names[name] = name
    return names


def shard_state_dict(full: dict[str, torch.Tensor], arch: ModelArch, par: ParallelConfig,
                     tp_rank: int, pp_rank: int, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """The stage state dict of (tp_rank, pp_rank, ep_rank), cut from a full state dict."""
    out = {local: split_full_tensor(name, full[name], arch, par)[tp_rank]
           for name, local in stage_names(arch, par, pp_rank, ep_rank).items()}
    if holds_tied_output_copy(arch, par, pp_rank):
        # Megatron keeps a copy of the tied embedding as the last stage's output layer.
        out["output_layer.weight"] = split_full_tensor(
            "output_layer.weight", full["embedding.word_embeddings.weight"], arch, par)[tp_rank]
    return out


def holds_tied_output_copy(arch: ModelArch, par: ParallelConfig, pp_rank: int) -> bool:
    """Whether this stage carries Megatron's copy of a tied embedding as `output_layer.weight`."""
    return arch.tied_embeddings and par.pp > 1 and pp_rank == par.pp - 1


def merge_state_dicts(stages: dict[tuple[int, ...], dict[str, torch.Tensor]], arch: ModelArch,
                      par: ParallelConfig) -> dict[str, torch.Tensor]:
    """The full state dict from every (tp_rank, pp_rank) stage state dict; with EP > 1 they are keyed
    (tp_rank, pp_rank, ep_rank)."""
    full: dict[str, torch.Tensor] = {}
    for ep_rank in range(par.ep):
        for pp_rank in range(par.pp):
            for name, local in stage_names(arch, par, pp_rank, ep_rank).items():
                if name in full:
                    continue  # the layers around the experts are the same on every EP rank
                keys = [(tp_rank, pp_rank) + ((ep_rank,) if par.ep > 1 else ()) for tp_rank in range(par.tp)]
                full[name] = merge_full_tensor(name, [stages[key][local] for key in keys], arch)
    return {name: full[name] for name in full_param_shapes(arch)}


def random_full_state_dict(arch: ModelArch, seed: int = 0, dtype: torch.dtype = torch.float32,
                           std: float = 0.02) -> dict[str, torch.Tensor]:
    """Seeded random weights for `arch` (norm weights near 1), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    full = {}
    for name, shape in full_param_shapes(arch).items():
        tensor = torch.randn(shape, generator=gen) * std
        if name.endswith(("layernorm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
            tensor = tensor + 1.0
        full[name] = tensor.to(dtype)
    return full
