"""LoRA adapters on the Megatron model's tensor-parallel linear layers, and their merge into the base weights.

Each targeted ColumnParallelLinear / RowParallelLinear keeps its own weight and gains a child `adapter` holding
`lora_A` [r, in] and `lora_B` [out, r], cut over the TP ranks as the base weight is: a column-parallel layer's B by
rows (A whole on every rank), a row-parallel layer's A by columns (B whole). A forward hook adds
(alpha / r)·B·A·x to the layer's output, so parameter names, the HF mapping and every caller of the layer stay
as they are. The few collectives the side path needs are over the layer's own TP group, and follow it into
sequence parallelism and into the experts (whose layers leave their communication to the token dispatcher):

- column-parallel: the input is gathered along the sequence under SP; A·x is the same on every rank, so its
  gradient is summed over the TP ranks (copy_to_tensor_model_parallel_region) and A gets the same gradient
  everywhere; an expert's layer instead sums A's gradient itself (its input gradient is a partial sum the
  dispatcher adds up, like the base weight's);
- row-parallel: A·x is a partial sum over the ranks' input columns, summed before B; under SP the result is cut
  along the sequence like the layer's output; an expert's layer leaves the output partial, as its base does, and
  sums B's gradient instead.

Megatron-Bridge's PEFT would have done this, but the release pip resolves for Python 3.11 (0.3.1) needs
transformers < 5, Transformer Engine and mamba-ssm, none of which mindrl runs.

The merge W + (alpha / r)·B·A is local to each rank's shard for both kinds of layer (B·A of the shards is the
shard of B·A), so the weight sync and the HF export use the one function here, per tensor, with no collective.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from mindrl.config.lora import LoraConfig
from mindrl.models import sharding

ADAPTER = "adapter"
A_NAME, B_NAME = f"{ADAPTER}.lora_A", f"{ADAPTER}.lora_B"


class _SumGradient(torch.autograd.Function):
    """Identity forward; the gradient summed over `group` (an expert's replicated adapter half)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class LoraAdapter(torch.nn.Module):
    """The two low-rank factors of one linear layer (this rank's shard) and their scale."""

    def __init__(self, layer: ColumnParallelLinear | RowParallelLinear, r: int, scale: float) -> None:
        super().__init__()
        self.column = isinstance(layer, ColumnParallelLinear)
        self.scale, self.enabled = scale, True
        weight = layer.weight
        out_local, in_local = weight.shape
        a_shape, b_shape = ((r, in_local), (out_local, r))
        self.lora_A = torch.nn.Parameter(weight.new_zeros(a_shape))
        self.lora_B = torch.nn.Parameter(weight.new_zeros(b_shape))
        # the half cut over TP, as its base weight: the grad norm counts it on every rank, the other half on one
        cut = (self.lora_B, 0) if self.column else (self.lora_A, 1)
        tensor_parallel.set_tensor_model_parallel_attributes(cut[0], True, cut[1], 1)
        for param in (self.lora_A, self.lora_B):
            param.allreduce = getattr(weight, "allreduce", True)  # an expert's reduce over expert-data-parallel ranks

    def delta(self, layer: ColumnParallelLinear | RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
        """(alpha / r)·B·A·x as the layer's output is laid out on this rank."""
        group = layer.tp_group
        tp = dist.get_world_size(group) if dist.is_initialized() else 1
        expert = layer.explicit_expert_comm
        a, b = self.lora_A, self.lora_B
        if expert and tp > 1:
            a, b = (_SumGradient.apply(a, group), b) if self.column else (a, _SumGradient.apply(b, group))
        if self.column:
            if layer.sequence_parallel and not expert:
                x = tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False,
                                                                         group=group)
            h = torch.nn.functional.linear(x, a)
            if not expert:
                h = tensor_parallel.copy_to_tensor_model_parallel_region(h, group=group)
            return torch.nn.functional.linear(h, b) * self.scale
        h = torch.nn.functional.linear(x, a)
        if expert:
            return torch.nn.functional.linear(h, b) * self.scale
        h = tensor_parallel.reduce_from_tensor_model_parallel_region(h, group=group)
        out = torch.nn.functional.linear(h, b) * self.scale
        if layer.sequence_parallel:
            out = tensor_parallel.scatter_to_sequence_parallel_region(out, group=group)
        return out


def _with_adapter(layer: ColumnParallelLinear | RowParallelLinear, args: tuple, kwargs: dict, output: tuple):
    adapter: LoraAdapter = getattr(layer, ADAPTER)
    if not adapter.enabled:
        return None
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter.delta(layer, x).to(out.dtype), bias


def targets(model: torch.nn.Module, cfg: LoraConfig) -> Iterator[tuple[str, ColumnParallelLinear | RowParallelLinear]]:
    """(local name, layer) of every linear layer of the language model `cfg` puts an adapter on (a vision tower
    keeps none)."""
    for name, module in model.named_modules():
        if name.startswith("decoder.") and name.rsplit(".", 1)[-1] in cfg.target_modules \
                and isinstance(module, ColumnParallelLinear | RowParallelLinear):
            yield name, module


def add_adapters(model: torch.nn.Module, cfg: LoraConfig, full_names: Mapping[str, str], seed: int,
                 trained: tuple[str, ...] = ()) -> int:
    """Put an adapter on every targeted layer of `model` (this rank's stage) and freeze everything else but the
    parameters whose names start with one of `trained` (a critic's new value head); returns how many.

    `full_names` maps a local parameter name to the whole model's (its layer and expert numbers), so A is drawn the
    same for a layer whatever the layout: PEFT's Kaiming-uniform over the whole A from a generator seeded by `seed`
    and the layer's full name, then this rank's columns of it. B starts at zero, so the adapted
    model starts as the base, bit for bit."""
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(trained) if trained else False)
    count = 0
    for name, layer in list(targets(model, cfg)):
        adapter = LoraAdapter(layer, cfg.r, cfg.scale)
        full = full_names[f"{name}.weight"].removesuffix(".weight")
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(full.encode()))
        in_full = layer.input_size
        bound = 1.0 / math.sqrt(in_full)  # kaiming_uniform_(a=sqrt(5)) of a [r, in] tensor, as PEFT draws lora_A
        whole = torch.empty(cfg.r, in_full).uniform_(-bound, bound, generator=generator)
        if not adapter.column:
            width = adapter.lora_A.shape[1]
            rank = dist.get_rank(layer.tp_group) if dist.is_initialized() else 0
            whole = whole[:, rank * width:(rank + 1) * width]
        with torch.no_grad():
            adapter.lora_A.copy_(whole)
        layer.add_module(ADAPTER, adapter)
        layer.register_forward_hook(_with_adapter, with_kwargs=True)
        gated = name.endswith("linear_fc1") and layer.config.gated_linear_unit
        layer.sharded_state_dict = _with_sharded_adapter(layer, layer.sharded_state_dict, gated)
        count += 1
    return count


def _with_sharded_adapter(layer: ColumnParallelLinear | RowParallelLinear, base: Callable[..., dict],
                          gated: bool) -> Callable[..., dict]:
    """The layer's part of a distributed checkpoint with its adapter's TP-cut factor described as cut (the
    layer's own description takes every tensor but its weight and bias as whole on every rank): a
    column-parallel B by rows, a row-parallel A by columns, and a gated fc1's B as two halves the way
    megatron-core stores the weight (gate rows, then up rows), so the whole-model tensors do not depend on TP."""

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        out = base(prefix, sharded_offsets, metadata)
        adapter: LoraAdapter = getattr(layer, ADAPTER)
        name, axis = (B_NAME, 0) if adapter.column else (A_NAME, 1)
        cut = make_sharded_tensors_for_checkpoint({name: getattr(adapter, name.rsplit(".", 1)[1])}, prefix,
                                                  {name: axis}, sharded_offsets, tp_group=layer.tp_group,
                                                  dp_cp_group=metadata["dp_cp_group"])
        if gated:
            key = f"{prefix}{B_NAME}"
            cut[key] = apply_swiglu_sharded_factory(cut[key], sharded_offsets,
                                                    (metadata or {}).get("singleton_local_shards", False))
        out.update(cut)
        return out

    return sharded_state_dict


def is_adapter(name: str) -> bool:
    return f".{ADAPTER}." in name


def adapters(model: torch.nn.Module) -> list[LoraAdapter]:
    return [m for m in model.modules() if isinstance(m, LoraAdapter)]


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model for the duration (`share_backbone`'s reference): every adapter adds nothing, not even a zero."""
    held = adapters(model)
    for adapter in held:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in held:
            adapter.enabled = True


def merged(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale·B·A of one rank's shards, computed in fp32 and rounded once to W's dtype."""
    delta = (lora_b.float() @ lora_a.float()) * scale
    return (weight.float() + delta).to(weight.dtype)


class MergedWeights(Mapping[str, torch.Tensor]):
    """A stage's tensors by name with each adapted weight merged, computed when asked for (one at a time: a sync
    never holds two merged copies) and without the adapters' own entries."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], scale: float) -> None:
        self.tensors, self.scale = tensors, scale

    def __getitem__(self, name: str) -> torch.Tensor:
        if is_adapter(name):
            raise KeyError(name)
        weight = self.tensors[name]
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{prefix}.{A_NAME}" in self.tensors:
            return merged(weight, self.tensors[f"{prefix}.{A_NAME}"], self.tensors[f"{prefix}.{B_NAME}"], self.scale)
        return weight

    def __iter__(self) -> Iterator[str]:
        return (name for name in self.tensors if not is_adapter(name))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _cut_half(name: str) -> str | None:
    """For an adapter tensor's name, the base weight whose TP cut it shares (None: it is whole on every rank)."""
    prefix, _, half = name.rpartition(f".{ADAPTER}.")
    column = prefix.rsplit(".", 1)[-1] in ("linear_qkv", "linear_fc1")
    return f"{prefix}.weight" if (half == "lora_B") == column else None


def split_adapter(name: str, tensor: torch.Tensor, tp: int, swiglu: bool) -> list[torch.Tensor]:
    """A whole adapter tensor (under its full name) → its slice on each TP rank, cut as its base weight is."""
    base = _cut_half(name)
    return sharding.tp_split(base, tensor, tp, swiglu) if base else [tensor.clone() for _ in range(tp)]


def merge_adapter_shards(name: str, shards: list[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """The TP ranks' slices of an adapter tensor → the whole tensor (inverse of split_adapter)."""
    base = _cut_half(name)
    return sharding.tp_merge(base, shards, swiglu) if base else shards[0]


def merged_parameters(model: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    """The model's parameters by name (detached), as an engine or an HF export takes them: adapters merged."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    held = adapters(model)
    return MergedWeights(params, held[0].scale) if held else params


def merge_state_dict(tensors: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A stage state dict with its adapters merged into their weights (the HF export's input)."""
    view = MergedWeights(tensors, scale)
    return {name: view[name] for name in view}


def base_digest(model: torch.nn.Module) -> str:
    """A digest of this rank's frozen base weights (names, dtypes, shapes and bytes): what an adapters-only
    checkpoint was trained on, and leaves out (a critic's value head trains beside the adapters and is saved)."""
    return weights_digest({name: p.detach() for name, p in model.named_parameters() if not p.requires_grad})


def weights_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """The digest of a stage's tensors, taken in name order: a model's parameters and a checkpoint's state dict,
    whatever order its writer kept, give the same one (the converter checks an adapters-only checkpoint's base).
    Each tensor is hashed from a copy: numpy's view of a tensor makes its storage unresizable for good, and the
    offload (offload_train_param) frees a parameter's memory by resizing it."""
    hasher = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        data = tensors[name].to("cpu", copy=True).contiguous()
        hasher.update(f"{name}{data.dtype}{tuple(data.shape)}".encode())
        hasher.update(data.view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()
