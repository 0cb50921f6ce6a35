"""Per-token KL estimators between the policy and the reference (`kl_penalty` / `kl_loss_type`).

With d = log π(a) − log π_ref(a) for sampled a ~ π:
- k1: d (unbiased, high variance, can be negative)
- abs: |d|
- k2 / mse: ½ d²
- k3 / low_var_kl: exp(−d) + d − 1 (Schulman's unbiased, non-negative estimator); d is
  clamped to [−20, 20] before the exponential and the result to [−10, 10], as verl and
  MindSpeed-RL do, so one wild token cannot blow up the loss.
"""

from __future__ import annotations

import math

import torch

from mindrl.algorithms.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator", "kl_penalty")


@KL_ESTIMATORS.register("k1", "kl")
def k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("abs")
def absolute(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


@KL_ESTIMATORS.register("k2", "mse")
def k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


#: the most a KL estimator's per-token value can be (k3's clamp); an adaptive target at or above it is never reached
K3_CEILING = 10.0


@KL_ESTIMATORS.register("k3", "low_var_kl")
def k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    log_ratio = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-K3_CEILING, K3_CEILING)


def kl_ceiling(kind: str) -> float:
    """The largest mean per-token KL estimator `kind` can report."""
    return K3_CEILING if KL_ESTIMATORS.get(kind) is k3 else math.inf


def kl_divergence(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    return KL_ESTIMATORS.get(kind)(log_prob, ref_log_prob)


def kl_penalized_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """KL as a reward penalty: each response's score on its last token, −coef·KL on every token."""
    token_rewards = -coef * kl * mask
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()
    return token_rewards + scores.unsqueeze(-1) * last


class KLController:
    """The coefficient of the KL penalty in the reward (`kl_ctrl_type`): fixed, or adaptive as Ziegler et al.
    (and verl, MindSpeed-RL) adapt it — after each batch, coef ·= 1 + clip(KL / kl_target − 1, ±0.2) ·
    n_steps / kl_horizon, so the measured KL is pulled towards the target. KL is what verl and MindSpeed-RL
    feed theirs: each response's mean per-token KL, averaged over the batch."""

    def __init__(self, kind: str, coef: float, target: float, horizon: int) -> None:
        self.kind, self.value, self.target, self.horizon = kind, coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.kind == "adaptive":
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
