"""How a [batch, tokens] loss matrix becomes one scalar (`loss_agg_mode`).

Each mode takes optional global normalisers (`num_tokens`, `num_seqs`) so a mini-batch
split into micro-batches gives the loss of the whole mini-batch: pass the mini-batch's
totals and sum the micro-batch results.
"""

from __future__ import annotations

import torch

from mindrl.algorithms.registry import Registry

LOSS_AGG_MODES: Registry = Registry("loss aggregation mode", "loss_agg_mode")


@LOSS_AGG_MODES.register("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None,
               num_seqs: float | None = None, norm_length: float | None = None) -> torch.Tensor:
    """Every valid token weighs the same (DAPO): Σ loss·mask / Σ mask."""
    tokens = mask.sum() if num_tokens is None else num_tokens
    return (loss * mask).sum() / max(float(tokens), 1.0)


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None,
                       num_seqs: float | None = None, norm_length: float | None = None) -> torch.Tensor:
    """Per sequence the token sum, then the mean over sequences."""
    seqs = loss.shape[0] if num_seqs is None else num_seqs
    return (loss * mask).sum() / max(float(seqs), 1.0)


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None,
                        num_seqs: float | None = None, norm_length: float | None = None) -> torch.Tensor:
    """Per sequence the token mean, then the mean over sequences (the original GRPO)."""
    seqs = loss.shape[0] if num_seqs is None else num_seqs
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / max(float(seqs), 1.0)


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None,
                            num_seqs: float | None = None, norm_length: float | None = None) -> torch.Tensor:
    """Dr. GRPO: token sums over a constant length L, mean over sequences.

    L must be a configured constant (the rollout's max new tokens): a default taken from the
    batch's padded width would move the effective learning rate with padding.
    """
    if norm_length is None:
        raise ValueError("seq-mean-token-sum-norm needs norm_length, the constant length L (the rollout's max "
                         "new tokens); set loss_norm_length.")
    seqs = loss.shape[0] if num_seqs is None else num_seqs
    return (loss * mask).sum() / (max(float(seqs), 1.0) * float(norm_length))


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, **normalisers) -> torch.Tensor:
    return LOSS_AGG_MODES.get(mode)(loss, mask, **normalisers)
