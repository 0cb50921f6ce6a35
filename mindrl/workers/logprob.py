"""Per-token log-probs and entropy from vocab-parallel logits, never gathering the vocabulary.

Each TP rank holds logits for its slice of the vocabulary; only per-token scalars (max,
sum of exponentials, sum of p·logit) cross the TP group. Logits are divided by the
sampling temperature first, so the log-probs are those of the distribution the rollout
sampled from. Rows added only to make the vocabulary divisible by TP are masked out:
their zero weights would otherwise give phantom tokens probability mass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel


def shifted_labels(tokens: torch.Tensor) -> torch.Tensor:
    """labels[:, t] = tokens[:, t + 1]: position t's logits score the next token (last column unused)."""
    labels = torch.roll(tokens, shifts=-1, dims=1)
    labels[:, -1] = 0
    return labels


def _prepared(logits: torch.Tensor, temperature: float, vocab_size: int | None) -> torch.Tensor:
    """fp32 logits / temperature (a new tensor: Megatron's cross entropy works in place), with
    this rank's columns at or past `vocab_size` set to the lowest float."""
    scaled = logits.to(torch.float32, copy=True)
    if temperature != 1.0:
        scaled.div_(temperature)
    if vocab_size is not None:
        local = scaled.shape[-1]
        first = parallel_state.get_tensor_model_parallel_rank() * local
        if first + local > vocab_size:
            scaled[..., max(vocab_size - first, 0):] = torch.finfo(scaled.dtype).min
    return scaled


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                             vocab_size: int | None = None) -> torch.Tensor:
    """log p(labels) under softmax(logits / temperature) over the first `vocab_size` ids; TP-aware."""
    return -tensor_parallel.vocab_parallel_cross_entropy(_prepared(logits, temperature, vocab_size), labels)


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        group = parallel_state.get_tensor_model_parallel_group()
        local_max = logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - local_max).exp()
        sum_exp = exp.sum(dim=-1, keepdim=True)
        dist.all_reduce(sum_exp, group=group)
        probs = exp / sum_exp
        mean_logit = (probs * logits).sum(dim=-1, keepdim=True)
        dist.all_reduce(mean_logit, group=group)
        entropy = sum_exp.log() + local_max - mean_logit
        ctx.save_for_backward(probs, logits, mean_logit)
        return entropy.squeeze(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        probs, logits, mean_logit = ctx.saved_tensors
        # H = log Z − Σ p·l  ⇒  ∂H/∂l_j = −p_j (l_j − Σ p·l); every term is local to the slice.
        return -grad.unsqueeze(-1) * probs * (logits - mean_logit)


#: tokens per piece of an entropy computed as a metric only: bounds its vocabulary-sized temporaries
_METRIC_CHUNK_TOKENS = 1024


def vocab_parallel_entropy(logits: torch.Tensor, temperature: float = 1.0, vocab_size: int | None = None,
                           grad: bool = True) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the first `vocab_size` ids; TP-aware. Without `grad` (or
    under no_grad) it is a metric: no graph, and computed a piece of tokens at a time, so its fp32 temporaries
    (a few logits-sized tensors) stay small beside the forward's own."""
    if grad and torch.is_grad_enabled():
        return _VocabParallelEntropy.apply(_prepared(logits, temperature, vocab_size))
    with torch.no_grad():
        flat = logits.reshape(-1, logits.shape[-1])
        pieces = [_VocabParallelEntropy.apply(_prepared(piece, temperature, vocab_size))
                  for piece in flat.split(_METRIC_CHUNK_TOKENS)]
        return torch.cat(pieces).view(logits.shape[:-1])


def gathered_log_probs(logits: torch.Tensor, source: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                       vocab_size: int | None = None, with_entropy: bool = False, entropy_grad: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `labels` [rows, S] (and entropies) scored at the positions of `logits` [G, W, V/TP] that
    `source` [rows, S] names as flat indices (−1: no score, 0 there). Packed rows score several rows'
    tokens at one position (the shared prompt's last), so the positions are picked before the softmax."""
    valid = source >= 0
    picked = logits.reshape(-1, logits.shape[-1]).index_select(0, source[valid])  # whole rows: no index kernel
    zeros = torch.zeros(source.shape, dtype=torch.float32, device=logits.device)
    log_probs = zeros.masked_scatter(valid, vocab_parallel_log_probs(picked, labels[valid], temperature, vocab_size))
    entropy = None
    if with_entropy:
        entropy = zeros.masked_scatter(valid, vocab_parallel_entropy(picked, temperature, vocab_size, entropy_grad))
    return log_probs, entropy
