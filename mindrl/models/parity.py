"""Parity checks: the same weights and batch under several TP/PP layouts, and DP replicas.

Every layout must give the logits, loss and gradients of TP=1, PP=1, and data-parallel
replicas must stay identical through optimizer steps. These are the checks that keep a
sharding bug from shipping; the tests and `cli/parallel_check.py` run them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state

from mindrl.config import ModelArch, ParallelConfig
from mindrl.distributed import init_model_parallel, release_model_parallel
from mindrl.models import sharding
from mindrl.models.forward import gather_logits, run_microbatches, token_cross_entropy
from mindrl.models.gpt import build_gpt_model, load_stage_weights
from mindrl.models.optimizer import wrap_for_training, zero_grads
from mindrl.platform import get_platform


@dataclass
class StageResult:
    """What one rank saw for one layout: its coordinates, its outputs and its gradients."""

    tp_rank: int
    pp_rank: int
    dp_rank: int
    logits: torch.Tensor | None
    losses: list[float]
    grads: dict[str, torch.Tensor]


def parity_batch(arch: ModelArch, batch_size: int = 4, seq_length: int = 16,
                 seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded tokens and their next-token labels, identical on every rank, on its device."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, arch.padded_vocab_size, (batch_size, seq_length), generator=gen)
    device = get_platform().device()
    return tokens.to(device), torch.roll(tokens, -1, dims=1).to(device)


def _sum_partial_grads_over_tp(model: torch.nn.Module) -> None:
    """Megatron's finalize step for a model run without its DDP wrapper: weights every TP rank holds whole but
    computes on part of the work (the norms under sequence parallelism: their shard of the tokens; QK norms: their
    heads) sum their gradients over TP."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    config = model.config
    for name, param in model.named_parameters():
        partial = (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or \
            (config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name))
        if partial and param.grad is not None:
            torch.distributed.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())


def run_layouts(rank: int, arch: ModelArch, layouts: list[ParallelConfig], seed: int = 0,
                micro_batch_size: int = 2) -> list[StageResult]:
    """On this rank: for each layout, load the seeded weights, run forward+backward once."""
    full = sharding.random_full_state_dict(arch, seed=seed)
    tokens, labels = parity_batch(arch)
    results = []
    for par in layouts:
        release_model_parallel()  # each layout is a fresh model on its own groups
        init_model_parallel(par, arch=arch)
        model = build_gpt_model(arch, par)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        load_stage_weights(model, sharding.shard_state_dict(full, arch, par, tp_rank, pp_rank))
        captured: list[torch.Tensor] = []

        def loss_fn(logits: torch.Tensor, batch: dict, captured=captured) -> tuple[torch.Tensor, dict]:
            captured.append(gather_logits(logits).detach().clone())
            return token_cross_entropy(logits, batch)

        micro = [{"tokens": tokens[i:i + micro_batch_size], "labels": labels[i:i + micro_batch_size]}
                 for i in range(0, tokens.shape[0], micro_batch_size)]
        outputs = run_microbatches(model, micro, loss_fn)
        _sum_partial_grads_over_tp(model)
        results.append(StageResult(
            tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=parallel_state.get_data_parallel_rank(),
            logits=torch.cat(captured).cpu() if captured else None,
            losses=[float(out["loss"]) for out in outputs],
            grads={name: p.grad.detach().cpu() for name, p in model.named_parameters()
                   if p.grad is not None}))
    return results


def join_layout(stage_results: list[StageResult], arch: ModelArch, par: ParallelConfig,
                ) -> tuple[torch.Tensor, list[float], dict[str, torch.Tensor]]:
    """Full logits, per-micro-batch losses and full-model gradients of one layout.

    With tied embeddings split across stages, the embedding's gradient is the sum of the
    first stage's and the last stage's copies (what Megatron's finalize step all-reduces).
    """
    replica = [r for r in stage_results if r.dp_rank == 0]
    last = next(r for r in replica if r.logits is not None)
    stages = {(r.tp_rank, r.pp_rank): r.grads for r in replica}
    grads = sharding.merge_state_dicts(stages, arch, par)
    if sharding.holds_tied_output_copy(arch, par, par.pp - 1):
        copies = [stages[(t, par.pp - 1)]["output_layer.weight"] for t in range(par.tp)]
        output = sharding.merge_full_tensor("output_layer.weight", copies, arch)
        grads["embedding.word_embeddings.weight"] = grads["embedding.word_embeddings.weight"] + output
    return last.logits[..., :arch.vocab_size_for(1)], last.losses, grads


@dataclass
class ReplicaResult:
    """One rank after a few optimizer steps: where it sits, what it learned, its weights."""

    dp_rank: int
    pp_rank: int
    optimizers: set[str]
    losses: list[float]
    initial: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]


def train_replicas(rank: int, arch: ModelArch, par: ParallelConfig, steps: int = 4,
                   lr: float = 1e-3) -> ReplicaResult:
    """A few steps of Megatron's distributed optimizer; each DP replica gets its own data.

    Data-parallel replicas must end bit-identical (the optimizer all-gathers the updated
    shards) and the loss must fall.
    """
    init_model_parallel(par, arch=arch)
    model = build_gpt_model(arch, par)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    initial = sharding.shard_state_dict(sharding.random_full_state_dict(arch), arch, par, tp_rank, pp_rank)
    load_stage_weights(model, initial)
    ddp, optimizer = wrap_for_training(model, lr=lr)
    dp_rank = parallel_state.get_data_parallel_rank()
    tokens, labels = parity_batch(arch, seed=100 + dp_rank)
    losses = []
    for _ in range(steps):
        zero_grads(ddp, optimizer)
        outputs = run_microbatches(ddp, [{"tokens": tokens[i:i + 2], "labels": labels[i:i + 2]}
                                         for i in range(0, tokens.shape[0], 2)], token_cross_entropy)
        updated, grad_norm, _ = optimizer.step()
        if not updated or not grad_norm > 0:
            raise RuntimeError(f"optimizer step skipped (grad norm {grad_norm})")
        if outputs:  # only the last pipeline stage computes the loss
            losses.append(sum(float(o["loss"]) for o in outputs) / len(outputs))
    return ReplicaResult(
        dp_rank=dp_rank, pp_rank=pp_rank,
        optimizers={type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])},
        losses=losses, initial=initial,
        params={name: p.detach().cpu().clone() for name, p in model.named_parameters()})
