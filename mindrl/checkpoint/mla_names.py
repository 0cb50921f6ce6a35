"""Multi-latent attention tensors as other writers lay them out, in the names and TP cuts mindrl reads.

mindrl's MLA layer keeps megatron-core's local-spec names, and its query and key-value projections are
column-parallel: each TP rank holds its rows of the two down projections and its heads of the up projections. Other
writers differ, and their checkpoints are what MindSpeed-RL's DeepSeek recipes start from:

- MindSpeed-LLM fuses both down projections into one `linear_qkv` (query rows, then key-value rows) that every TP
  rank holds whole; it names the up projections `linear_qb` / `linear_kvb` (newer releases: `linear_q_up_proj` /
  `linear_kv_up_proj`) and the key-value latent's norm `k_layernorm`. With `--mla-mm-split` each up projection is
  stored in two per-head halves: `linear_qk_nope` + `linear_qk_rope`, `linear_kv_nope` + `linear_v`.
- Megatron-LM's Transformer Engine spec keeps the down projections whole on every TP rank ("duplicated") and fuses
  each latent's norm into the up projection after it (`layer_norm_weight`).

A whole tensor is cut to the rank's rows here, so a checkpoint reads at the layout it was written at. These are
per-rank (`torch`) files; distributed (`torch_dist`) ones are read under mindrl's own names only.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from mindrl.checkpoint.megatron_args import with_mla_names
from mindrl.config import ConfigError
from mindrl.models import arch_fields as af

_ATTENTION = "self_attention."
_RENAMES = {"linear_qb.weight": "linear_q_up_proj.weight", "linear_kvb.weight": "linear_kv_up_proj.weight",
            "k_layernorm.weight": "kv_layernorm.weight",
            "linear_q_up_proj.layer_norm_weight": "q_layernorm.weight",
            "linear_kv_up_proj.layer_norm_weight": "kv_layernorm.weight"}
#: per-head halves of an up projection (`--mla-mm-split`) → the projection, its halves in per-head order
_HALVES = {"linear_qk_nope.weight": ("linear_q_up_proj.weight", 0),
           "linear_qk_rope.weight": ("linear_q_up_proj.weight", 1),
           "linear_kv_nope.weight": ("linear_kv_up_proj.weight", 0),
           "linear_v.weight": ("linear_kv_up_proj.weight", 1)}


@dataclass(frozen=True)
class MLACut:
    """What reading another writer's MLA tensors on one TP rank needs."""

    q_latent: int | None  # q_lora_rank; None: the query is one projection (linear_q_proj)
    query_rows: int  # of linear_q_proj: heads × (qk_head_dim + qk_pos_emb_head_dim)
    kv_rows: int  # of the key-value down projection: kv_lora_rank + qk_pos_emb_head_dim
    nope: int  # qk_head_dim
    rope: int  # qk_pos_emb_head_dim
    value: int  # v_head_dim
    tp: int
    tp_rank: int

    @property
    def q_down_rows(self) -> int:
        return self.query_rows if self.q_latent is None else self.q_latent

    def rank_rows(self, tensor: torch.Tensor, full: int, where: str) -> torch.Tensor:
        """The rank's rows of a tensor every rank holds whole (`full` rows); as it is if already cut. Its rows tell
        which: whole, `full`; cut, `full` / TP, which differs for TP > 1 (any other count is refused later, as
        every tensor whose shape the architecture does not give)."""
        if self.tp == 1 or tensor.shape[0] != full:
            return tensor
        if full % self.tp:
            raise ConfigError(f"{where} holds all {full} rows on every TP rank, which do not split over "
                              f"tensor_model_parallel_size={self.tp}; convert the checkpoint at a TP that divides "
                              f"them.")
        return tensor.chunk(self.tp)[self.tp_rank].clone()


def mla_cut(args: Any, tp_rank: int) -> MLACut | None:
    """The cut on TP rank `tp_rank` of a multi-latent attention checkpoint, from its args (Megatron-LM's names, or
    MindSpeed-LLM's older ones); None for a model without MLA or args that do not say."""
    if not isinstance(args, argparse.Namespace):
        return None
    args = with_mla_names(args)
    sizes = [af.megatron_value(args, f) for f in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")]
    heads = getattr(args, "num_attention_heads", None)
    if not af.megatron_value(args, "multi_latent_attention") or None in sizes or not heads:
        return None
    latent, nope, rope, value = map(int, sizes)
    q_latent = af.megatron_value(args, "q_lora_rank")
    return MLACut(int(q_latent) if q_latent else None, int(heads) * (nope + rope), latent + rope, nope, rope, value,
                  int(getattr(args, "tensor_model_parallel_size", None) or 1), tp_rank)


def to_local_spec(model: dict[str, torch.Tensor], cut: MLACut, where: str) -> dict[str, torch.Tensor]:
    """A chunk's MLA tensors under mindrl's names, each rank's rows of those every rank held whole."""
    out: dict[str, torch.Tensor] = {}
    halves: dict[str, dict[int, torch.Tensor]] = {}
    down = {"linear_q_down_proj.weight": cut.q_down_rows, "linear_kv_down_proj.weight": cut.kv_rows}
    for name, value in model.items():
        prefix, found, rest = name.partition(_ATTENTION)
        if not found or not prefix.startswith("decoder.layers."):
            out[name] = value
        elif rest in _RENAMES:
            out[prefix + _ATTENTION + _RENAMES[rest]] = value
        elif rest == "linear_qkv.weight":
            out.update(_fused_down(prefix + _ATTENTION, value, cut, where + f" {name}"))
        elif rest in down:
            out[name] = cut.rank_rows(value, down[rest], f"{where} {name}")
        elif rest in _HALVES:
            joined, half = _HALVES[rest]
            halves.setdefault(prefix + _ATTENTION + joined, {})[half] = value
        else:
            out[name] = value
    for name, pair in halves.items():
        out[name] = _join_heads(name, pair, cut, where)
    return out


def _fused_down(prefix: str, value: torch.Tensor, cut: MLACut, where: str) -> dict[str, torch.Tensor]:
    """MindSpeed-LLM's `linear_qkv`: the query's down projection (or whole projection) over the key-value one."""
    rows = cut.q_down_rows + cut.kv_rows
    if value.dim() != 2 or value.shape[0] != rows:
        raise ConfigError(f"{where} has shape {tuple(value.shape)}, not the {rows} rows of the query and key-value "
                          f"down projections the args' MLA sizes give; the args do not match the weights.")
    query, kv = value.split([cut.q_down_rows, cut.kv_rows])
    q_name = "linear_q_proj.weight" if cut.q_latent is None else "linear_q_down_proj.weight"
    return {prefix + q_name: cut.rank_rows(query, cut.q_down_rows, where),
            prefix + "linear_kv_down_proj.weight": cut.rank_rows(kv, cut.kv_rows, where)}


def _join_heads(name: str, pair: dict[int, torch.Tensor], cut: MLACut, where: str) -> torch.Tensor:
    """An up projection from its per-head halves: each head's rows [no position | rotated] for the query,
    [key | value] for the key-value latent."""
    widths = (cut.nope, cut.rope) if "linear_q_up_proj" in name else (cut.nope, cut.value)
    if len(pair) != 2:
        raise ConfigError(f"{where}: {name} is stored split per head (MindSpeed-LLM's --mla-mm-split), but one of "
                          f"its two halves is missing; the checkpoint is incomplete.")
    first, second = pair[0], pair[1]
    heads = first.shape[0] // widths[0]
    if first.shape[0] != heads * widths[0] or second.shape[0] != heads * widths[1]:
        raise ConfigError(f"{where}: the halves of {name} have {first.shape[0]} and {second.shape[0]} rows, which "
                          f"are not whole heads of {widths[0]} and {widths[1]}; the args do not match the weights.")
    return torch.cat([first.reshape(heads, widths[0], -1), second.reshape(heads, widths[1], -1)],
                     dim=1).reshape(heads * sum(widths), -1)
