"""Training–inference mismatch correction (`rollout_is`, `rollout_is_threshold`).

The rollout engine (vLLM, another kernel set, another precision) samples from π_engine,
which is not exactly the actor's π_old that the PPO ratio is taken against, so the
"on-policy" update is silently off-policy. Truncated importance sampling reweights each
token's policy-gradient loss by min(π_old / π_engine, C), as verl's TIS fix does
("Your efficient RL framework secretly brings you off-policy RL training"): the
truncation at C keeps the variance bounded when the engine assigned a sampled token
a much smaller probability than the actor does.

Modes (a registry keyed by `rollout_is`; each maps the per-token log ratio old − engine to
the untruncated log weight, and the cap at C = `rollout_is_threshold` is applied after):
- none: weight 1 on every response token (the uncorrected loss)
- token: min(exp(old − engine), C) per token
- sequence: min(exp(Σ_response (old − engine)), C), one weight for all tokens of a response

Weights are 0 outside the response mask, so padded engine log-probs cannot leak in, and
are detached constants: they scale the loss but carry no gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mindrl.algorithms.kl import k3
from mindrl.algorithms.registry import Registry
from mindrl.config.errors import ConfigError

ROLLOUT_IS_MODES: Registry = Registry("rollout importance-sampling mode", "rollout_is")

#: C in min(ratio, C): verl's default; a token the engine under-sampled by more than 2×
#: still counts, but at most twice.
DEFAULT_THRESHOLD = 2.0


@dataclass(frozen=True)
class RolloutISConfig:
    rollout_is: str = "none"
    rollout_is_threshold: float = DEFAULT_THRESHOLD

    def __post_init__(self) -> None:
        ROLLOUT_IS_MODES.get(self.rollout_is)
        threshold = self.rollout_is_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 1.0 <= threshold < math.inf:
            raise ConfigError(f"rollout_is_threshold must be a finite number >= 1 (the cap on the importance "
                              f"weight), got {threshold!r}.")


@ROLLOUT_IS_MODES.register("none")
def no_correction(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(log_ratio)


@ROLLOUT_IS_MODES.register("token")
def token_level(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return log_ratio


@ROLLOUT_IS_MODES.register("sequence")
def sequence_level(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (log_ratio * mask).sum(-1, keepdim=True).expand_as(log_ratio)


def _log_ratio(old_log_prob: torch.Tensor, engine_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if old_log_prob.shape != engine_log_prob.shape or old_log_prob.shape != mask.shape:
        raise ValueError(f"old log-probs {tuple(old_log_prob.shape)}, engine log-probs "
                         f"{tuple(engine_log_prob.shape)} and mask {tuple(mask.shape)} must have one shape; "
                         f"align the engine's log-probs to the actor's token positions.")
    # Outside the mask the engine may hold padding (0 or -inf); zero it before any sum.
    return torch.where(mask.bool(), old_log_prob.float() - engine_log_prob.float(), 0.0)


def _log_weights(old_log_prob: torch.Tensor, engine_log_prob: torch.Tensor, mask: torch.Tensor,
                 mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    log_ratio = _log_ratio(old_log_prob, engine_log_prob, mask)
    return log_ratio, ROLLOUT_IS_MODES.get(mode)(log_ratio, mask)


@torch.no_grad()
def rollout_is_weights(old_log_prob: torch.Tensor, engine_log_prob: torch.Tensor, mask: torch.Tensor,
                       cfg: RolloutISConfig) -> torch.Tensor:
    """[batch, tokens] weights that multiply the per-token policy-gradient loss."""
    mask = mask.float()
    _, log_weight = _log_weights(old_log_prob, engine_log_prob, mask, cfg.rollout_is)
    # Truncating in log space keeps a huge Σ(old − engine) from overflowing to inf.
    return log_weight.clamp(max=math.log(cfg.rollout_is_threshold)).exp() * mask


@torch.no_grad()
def mismatch_metrics(old_log_prob: torch.Tensor, engine_log_prob: torch.Tensor, mask: torch.Tensor,
                     cfg: RolloutISConfig) -> dict[str, float]:
    """How far the engine is from the actor, over response tokens, whatever the mode.

    `truncated_frac` is the share of response tokens whose weight the threshold cut under
    the configured mode (0 for none); the k3 estimate is KL(π_engine ‖ π_old) from the
    engine's own samples, so it is >= 0 and 0 only when the two agree on every token.
    """
    mask = mask.float()
    tokens = mask.sum().clamp(min=1.0)
    log_ratio, log_weight = _log_weights(old_log_prob, engine_log_prob, mask, cfg.rollout_is)
    cap = math.log(cfg.rollout_is_threshold)
    abs_diff = log_ratio.abs()
    # k3(engine, old) = exp(old − engine) − (old − engine) − 1 on the masked log ratio.
    kl = k3(-log_ratio, torch.zeros_like(log_ratio)) * mask
    weights = log_weight.clamp(max=cap).exp() * mask
    return {
        "rollout_is/abs_log_prob_diff_mean": (abs_diff.sum() / tokens).item(),
        "rollout_is/abs_log_prob_diff_max": abs_diff.max().item() if mask.any() else 0.0,
        "rollout_is/k3_kl": (kl.sum() / tokens).item(),
        "rollout_is/truncated_frac": (((log_weight > cap).float() * mask).sum() / tokens).item(),
        "rollout_is/weight_mean": (weights.sum() / tokens).item(),
    }


@torch.no_grad()
def mismatch_shares(actor_log_prob: torch.Tensor, engine_log_prob: torch.Tensor, mask: torch.Tensor,
                    num_tokens: float) -> dict[str, float]:
    """One micro-batch's share of `mismatch_metrics`' two means over a batch of `num_tokens`
    response tokens: summed over micro-batches and ranks they are the batch's means. Used when
    the update's own forward pass stands in for the old log-prob pass, where a max cannot be summed."""
    mask = mask.float()
    log_ratio = _log_ratio(actor_log_prob, engine_log_prob, mask)
    kl = k3(-log_ratio, torch.zeros_like(log_ratio)) * mask
    tokens = max(num_tokens, 1.0)
    return {"rollout_is/abs_log_prob_diff_mean": (log_ratio.abs().sum() / tokens).item(),
            "rollout_is/k3_kl": (kl.sum() / tokens).item()}
