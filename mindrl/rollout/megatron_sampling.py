"""Drawing tokens from full-vocabulary logits the way vLLM's sampler does.

vLLM (v1) processes logits in this order: divide by the temperature, drop tokens whose
probability is below min_p × the top probability, keep the top_k (ties at the k-th value
stay), then keep the smallest set of most likely tokens whose mass reaches top_p. The
sampled token's log-prob is its log-softmax over what is left ("processed_logprobs").
Following the same order keeps the Megatron backend's log-probs interchangeable with the
vLLM backend's; with every filter off it is exactly log_softmax(logits / temperature).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mindrl.rollout.config import SamplingConfig


def processed_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """fp32 [rows, vocab] logits / temperature with every filtered-out token at -inf."""
    scaled = logits.float() / sampling.temperature
    if sampling.min_p > 0:
        probs = scaled.softmax(dim=-1)
        scaled = scaled.masked_fill(probs < sampling.min_p * probs.amax(dim=-1, keepdim=True), -torch.inf)
    if 0 < sampling.top_k < scaled.shape[-1]:
        kth = scaled.topk(sampling.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, -torch.inf)
    if sampling.top_p < 1:
        ascending, order = scaled.sort(dim=-1)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
        drop[:, -1] = False  # the most likely token always stays
        scaled = scaled.scatter(-1, order, ascending.masked_fill(drop, -torch.inf))
    return scaled


def sample(logits: torch.Tensor, sampling: SamplingConfig,
           generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of [rows, vocab] logits, drawn with that row's generator, and its log-prob
    under the processed distribution.

    top_k = 1 is greedy decoding: the first arg-max, drawing nothing. Otherwise the exponential
    race (argmax p / E with E ~ Exp(1)) draws exactly from p in one pass; E = -log U from
    uniform draws, several times faster than exponential_ on a CPU. A row's draws come from its
    own generator only, so a sample does not depend on which other rows share its batch.
    """
    log_probs = processed_logits(logits, sampling).log_softmax(dim=-1)
    if sampling.top_k == 1:
        tokens = log_probs.argmax(dim=-1)
    else:
        race = torch.empty_like(log_probs)
        for row, generator in zip(race, generators, strict=True):
            row.uniform_(generator=generator)
        tokens = log_probs.exp().div_(race.log_().neg_()).argmax(dim=-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
