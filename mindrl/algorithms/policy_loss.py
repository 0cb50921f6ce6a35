"""The actor's loss: clipped policy gradient (+ KL loss, − entropy bonus), aggregated.

PPO clip (`policy_loss: ppo`) with ratio r = exp(log π − log π_old):
  pg = max(−A·r, −A·clip(r, 1 − clip_ratio_low, 1 + clip_ratio_high))
`clip_ratio_low/high` default to `clip_ratio` (DAPO's clip-higher sets them apart). With
`clip_ratio_c` (dual clip, > 1), a negative-advantage token's loss is also capped at
−A·clip_ratio_c, so a huge ratio on a bad token cannot dominate.

GSPO (`policy_loss: gspo`, Zheng et al. 2025, as verl computes it) clips one ratio per response, the
geometric mean of its tokens' ratios s = exp(mean_t(log π − log π_old)), so a whole response is kept or
dropped: one token whose probability moved far (an MoE routing flip) cannot clip its neighbours alone.
Each token carries s's value with its own log-prob's gradient (GSPO-token: sg[s]·π/sg[π]); with the
response-level advantages of GRPO that is GSPO's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mindrl.algorithms.aggregation import LOSS_AGG_MODES, aggregate
from mindrl.algorithms.kl import KL_ESTIMATORS, kl_divergence
from mindrl.algorithms.registry import Registry
from mindrl.config.errors import ConfigError

PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "LossConfig"],
                      tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "policy_loss")


@dataclass(frozen=True)
class LossConfig:
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = None
    loss_agg_mode: str = "token-mean"
    #: Dr. GRPO's constant length L for seq-mean-token-sum-norm: the rollout's max new tokens
    loss_norm_length: int | None = None
    use_kl_loss: bool = False
    kl_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    policy_loss: str = "ppo"

    def __post_init__(self) -> None:
        LOSS_AGG_MODES.get(self.loss_agg_mode)
        KL_ESTIMATORS.get(self.kl_loss_type)
        POLICY_LOSSES.get(self.policy_loss)
        if self.policy_loss == "gspo" and self.clip_ratio_c is not None:
            raise ConfigError("clip_ratio_c (dual clip) caps token ratios, which policy_loss gspo does not clip; "
                              "remove clip_ratio_c or use policy_loss ppo.")
        if not 0.0 < self.low < 1.0 or self.high <= 0.0:
            raise ConfigError(f"clip ratios must satisfy 0 < clip_ratio_low < 1 and clip_ratio_high > 0, got "
                              f"low={self.low}, high={self.high}.")
        if self.low > self.high:
            raise ConfigError(f"clip_ratio_low={self.low} exceeds clip_ratio_high={self.high}; clip-higher needs "
                              f"low <= high.")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_norm_length is None:
            raise ConfigError("loss_agg_mode seq-mean-token-sum-norm needs loss_norm_length, the constant length "
                              "each response's token sum is divided by; set it to the rollout's max_tokens.")
        if self.loss_norm_length is not None and (not isinstance(self.loss_norm_length, int)
                                                  or self.loss_norm_length < 1):
            raise ConfigError(f"loss_norm_length must be a positive integer, got {self.loss_norm_length!r}.")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ConfigError(f"clip_ratio_c={self.clip_ratio_c} must be > 1 (dual clip caps the loss at -A*c).")

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@POLICY_LOSSES.register("ppo", "vanilla")
def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped PG loss and per-token indicators (clipped, dual-clipped)."""
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20.0, 20.0))
    loss, flags = _clipped(ratio, advantages, cfg)
    if cfg.clip_ratio_c is not None:
        capped = torch.minimum(loss, -advantages * cfg.clip_ratio_c)
        flags["dual_clipped"] = ((advantages < 0) & (capped < loss)).float()
        loss = torch.where(advantages < 0, capped, loss)
    return loss, flags


@POLICY_LOSSES.register("gspo")
def gspo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GSPO loss over rows of one response each: every token's ratio is its response's
    geometric-mean ratio (log capped at 10, as verl caps it), with the token's own gradient."""
    mask = mask.float()
    seq_log_ratio = ((log_prob - old_log_prob) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    return _clipped(torch.exp(log_ratio.clamp(max=10.0)), advantages, cfg)


def _clipped(ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.low, 1.0 + cfg.high)
    return torch.maximum(unclipped, clipped), {"clipped": (clipped > unclipped).float(), "ratio": ratio.detach()}


def actor_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, cfg: LossConfig, ref_log_prob: torch.Tensor | None = None,
               entropy: torch.Tensor | None = None, num_tokens: float | None = None,
               num_seqs: float | None = None,
               is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar the actor minimises, and its parts as metrics.

    With the whole mini-batch's `num_tokens` / `num_seqs` (summed over micro-batches and
    data-parallel ranks), the loss and every metric of one micro-batch are its *share*:
    summing them over micro-batches and ranks gives the mini-batch's value. The loss terms
    are aggregated by `loss_agg_mode`; entropy and the clip / KL-to-old diagnostics are
    per-token means, whatever the mode, so they read the same in every configuration.
    `is_weights` (rollout_is.rollout_is_weights) scale each token's clipped PG loss as
    constants, correcting for the rollout engine sampling from a slightly different policy.
    """
    mask = mask.float()
    normalisers = {"num_tokens": num_tokens, "num_seqs": num_seqs, "norm_length": cfg.loss_norm_length}

    def per_token(values: torch.Tensor) -> float:
        return aggregate(values.detach(), mask, "token-mean", num_tokens=num_tokens).item()

    pg, flags = POLICY_LOSSES.get(cfg.policy_loss)(log_prob, old_log_prob, advantages, mask, cfg)
    if is_weights is not None:
        pg = pg * is_weights.detach()
    pg_loss = aggregate(pg, mask, cfg.loss_agg_mode, **normalisers)
    total = pg_loss
    metrics = {"pg_loss": pg_loss.item(), "clip_fraction": per_token(flags["clipped"]),
               "approx_kl_old": per_token(0.5 * (log_prob - old_log_prob) ** 2)}
    if "dual_clipped" in flags:
        metrics["dual_clip_fraction"] = per_token(flags["dual_clipped"])
    if cfg.use_kl_loss:
        if ref_log_prob is None:
            raise ValueError("use_kl_loss needs the reference log-probs.")
        kl_loss = aggregate(kl_divergence(log_prob, ref_log_prob, cfg.kl_loss_type), mask, cfg.loss_agg_mode,
                            **normalisers)
        total = total + cfg.kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.item()
    if entropy is not None:
        metrics["entropy"] = per_token(entropy)
        if cfg.entropy_coeff:
            total = total - cfg.entropy_coeff * aggregate(entropy, mask, cfg.loss_agg_mode, **normalisers)
    return total, metrics
