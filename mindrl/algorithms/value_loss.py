"""The critic's loss: clipped value regression onto the GAE returns (PPO's, as verl and OpenRLHF write it).

    v_clip = clamp(v, v_old − cliprange_value, v_old + cliprange_value)
    loss   = ½ · agg(max((v − R)², (v_clip − R)²))
v_old is the critic's value when the batch was scored: the clip keeps one batch from moving a value
further than `cliprange_value`, and the max makes it pessimistic, as the policy's clip is. `agg` is the
policy loss's `loss_agg_mode`, with the same whole-mini-batch normalisers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mindrl.algorithms.aggregation import LOSS_AGG_MODES, aggregate
from mindrl.config.errors import ConfigError


@dataclass(frozen=True)
class ValueLossConfig:
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    #: Dr. GRPO's constant length, where loss_agg_mode is seq-mean-token-sum-norm
    loss_norm_length: int | None = None

    def __post_init__(self) -> None:
        LOSS_AGG_MODES.get(self.loss_agg_mode)
        if not self.cliprange_value > 0:
            raise ConfigError(f"cliprange_value must be positive (how far one batch may move a value), got "
                              f"{self.cliprange_value}.")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cfg: ValueLossConfig, num_tokens: float | None = None,
               num_seqs: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss and its metrics (vf_loss, vf_clipfrac: share of tokens where the clipped error won,
    vpred_mean), each as a share of the mini-batch's value given its normalisers."""
    mask = mask.float()
    clipped = old_values + (values - old_values).clamp(-cfg.cliprange_value, cfg.cliprange_value)
    plain_error, clipped_error = (values - returns).square(), (clipped - returns).square()
    loss = 0.5 * aggregate(torch.maximum(plain_error, clipped_error), mask, cfg.loss_agg_mode, num_tokens=num_tokens,
                           num_seqs=num_seqs, norm_length=cfg.loss_norm_length)

    def per_token(x: torch.Tensor) -> float:
        return aggregate(x.detach().float(), mask, "token-mean", num_tokens=num_tokens).item()

    return loss, {"vf_loss": loss.item(), "vf_clipfrac": per_token(clipped_error > plain_error),
                  "vpred_mean": per_token(values)}
