"""Generalised advantage estimation (`adv_estimator: gae`, PPO with a critic).

Position t of a row is a state (the tokens up to t) whose action is token t + 1: where
`mask[t]` is 1, `values[t]` is the critic's V(s_t) and `token_rewards[t]` the reward for that
action (the outcome score at the last response token, minus any KL penalty). Then
    δ_t = r_t + γ·V_{t+1} − V_t,    A_t = δ_t + γλ·A_{t+1},    returns_t = A_t + V_t
with V and A zero past the response's last token. Positions outside the mask are skipped — the
recursion carries V and A across them unchanged, as verl does — so values the critic wrote on
prompt or padding positions never leak into the response's advantages. The advantages are then
whitened over the batch's response tokens; the returns (the critic's targets) stay on the reward's
scale. γ = λ = 1 gives Monte-Carlo returns minus the value; λ = 0 the one-step TD error.
"""

from __future__ import annotations

import torch

from mindrl.algorithms.advantages import masked_whiten


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                   lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(whitened advantages, returns), both [batch, tokens] and zero outside `mask`; computed in float64."""
    rewards, values, mask = token_rewards.double(), values.double(), mask.double()
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        inside = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = inside * (delta + gamma * lam * running) + (1 - inside) * running
        next_value = inside * values[:, t] + (1 - inside) * next_value
        advantages[:, t] = running
    returns = (advantages + values) * mask
    return masked_whiten(advantages * mask, mask).float(), returns.float()


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(returns − values) / Var(returns) over the response tokens: 1 when the critic predicts the
    returns, 0 when it does no better than their mean, negative when worse (verl's critic/vf_explained_var)."""
    inside = mask.bool()
    target, predicted = returns[inside].double(), values[inside].double()
    if target.numel() < 2:
        return float("nan")
    return (1.0 - (target - predicted).var() / (target.var() + 1e-5)).item()
