"""Advantage estimators (`adv_estimator`), from per-response scores to per-token advantages.

Responses to the same prompt are stored contiguously in groups of `group_size`
(`n_samples_per_prompt`). Outcome estimators give every token of a response its
response's advantage; REINFORCE++ works on token-level rewards (score on the last token,
minus any KL penalty) and whitens over the whole batch.

A group whose responses all scored the same carries no signal, and every estimator that
compares a response with its group gives it exactly 0. Arithmetic alone does not: the mean of
eight float32 copies of -0.9 is not -0.9, and group_norm divides that rounding by std + eps,
both ~1e-7, into an advantage of +0.056 on every token of an all-wrong group. So group
statistics are taken in float64 and flat groups are set to 0 explicitly.
"""

from __future__ import annotations

import torch

from mindrl.algorithms.registry import Registry
from mindrl.config.errors import ConfigError

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator", "adv_estimator")


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[prompts, group_size] in float64."""
    if scores.ndim != 1 or scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not form groups of {group_size}; the batch must hold "
                         f"n_samples_per_prompt responses for every prompt, stored contiguously.")
    return scores.view(-1, group_size).double()


def _flat(grouped: torch.Tensor) -> torch.Tensor:
    """[prompts, 1]: True where every score of the group is equal."""
    return (grouped == grouped[:, :1]).all(-1, keepdim=True)


def _zero_flat(values: torch.Tensor, grouped: torch.Tensor) -> torch.Tensor:
    """`values` [prompts, group_size] with every group whose scores are all equal set to exactly 0."""
    return values.masked_fill(_flat(grouped), 0.0)


def _per_token(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values.to(mask.dtype).unsqueeze(-1) * mask


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Mean 0 and (unbiased) variance 1 over the masked tokens of the whole batch, 0 elsewhere (verl's)."""
    count = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / count
    var = (((values - mean) * mask) ** 2).sum() / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps) * mask


@ADVANTAGE_ESTIMATORS.register("group_norm", "grpo")
def group_norm(scores: torch.Tensor, mask: torch.Tensor, group_size: int, eps: float = 1e-6,
               **_: object) -> torch.Tensor:
    """GRPO: (r − group mean) / (group std + eps), std unbiased; a group of one gets 0."""
    grouped = _groups(scores, group_size)
    mean = grouped.mean(-1, keepdim=True)
    std = grouped.std(-1, keepdim=True) if group_size > 1 else torch.ones_like(mean)
    return _per_token(_zero_flat((grouped - mean) / (std + eps), grouped).view(-1), mask)


@ADVANTAGE_ESTIMATORS.register("group_mean", "dr_grpo")
def group_mean(scores: torch.Tensor, mask: torch.Tensor, group_size: int, **_: object) -> torch.Tensor:
    """Dr. GRPO: r − group mean, no division by the std."""
    grouped = _groups(scores, group_size)
    return _per_token(_zero_flat(grouped - grouped.mean(-1, keepdim=True), grouped).view(-1), mask)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(scores: torch.Tensor, mask: torch.Tensor, group_size: int, **_: object) -> torch.Tensor:
    """Leave-one-out: r_i − mean of the other responses of its prompt."""
    if group_size < 2:
        raise ValueError("rloo needs n_samples_per_prompt >= 2 (a baseline from the other responses).")
    grouped = _groups(scores, group_size)
    others = (grouped.sum(-1, keepdim=True) - grouped) / (group_size - 1)
    return _per_token(_zero_flat(grouped - others, grouped).view(-1), mask)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(scores: torch.Tensor, mask: torch.Tensor, group_size: int,
                        token_rewards: torch.Tensor | None = None, gamma: float = 1.0,
                        **_: object) -> torch.Tensor:
    """REINFORCE++: discounted return-to-go of token rewards, whitened over the batch."""
    if token_rewards is None:
        token_rewards = _per_token(torch.zeros_like(scores), mask)
        last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()
        token_rewards = token_rewards + scores.unsqueeze(-1) * last
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running * mask[:, t]
        returns[:, t] = running
    return masked_whiten(returns, mask)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(scores: torch.Tensor, mask: torch.Tensor, group_size: int,
                                 **_: object) -> torch.Tensor:
    """REINFORCE++ with a baseline: r − group mean, then whitened over the batch's tokens (as verl does);
    a flat group's tokens then hold minus the batch's token mean over its std, and are set back to 0."""
    grouped = _groups(scores, group_size)
    centred = _zero_flat(grouped - grouped.mean(-1, keepdim=True), grouped).view(-1)
    whitened = masked_whiten(_per_token(centred, mask), mask)
    return whitened.masked_fill(_flat(grouped).repeat_interleave(group_size, dim=0), 0.0)


#: the estimators that compare the responses of one prompt: a group of one gives zero advantages
GROUP_ESTIMATORS = frozenset(name for name in ADVANTAGE_ESTIMATORS.names() if ADVANTAGE_ESTIMATORS.get(name) in
                             (group_norm, group_mean, rloo, reinforce_plus_plus_baseline))


#: estimators that need a learned critic's values (mindrl/algorithms/gae.py); cli/train_ppo.py trains them
CRITIC_ESTIMATORS = ("gae",)


def check_estimator(name: str) -> None:
    """One sentence for an `adv_estimator` neither table knows."""
    if name not in CRITIC_ESTIMATORS and name not in ADVANTAGE_ESTIMATORS.names():
        known = ", ".join(sorted([*ADVANTAGE_ESTIMATORS.names(), *CRITIC_ESTIMATORS]))
        raise ConfigError(f"unknown advantage estimator {name!r} for adv_estimator; known: {known}.")


def compute_advantages(name: str, scores: torch.Tensor, mask: torch.Tensor, group_size: int,
                       **kwargs: object) -> torch.Tensor:
    """[batch, tokens] advantages, zero outside `mask`."""
    return ADVANTAGE_ESTIMATORS.get(name)(scores.float(), mask.float(), group_size, **kwargs)
