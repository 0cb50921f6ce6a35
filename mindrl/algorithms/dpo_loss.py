"""Preference losses (`dpo_loss_type`) on the log-prob ratios of a chosen and a rejected response.

With π and π_ref the policy's and the reference's sequence log-probs of a response,
  Δ = (π(chosen) − π_ref(chosen)) − (π(rejected) − π_ref(rejected))
and β = `dpo_beta`, ε = `dpo_label_smoothing`, the losses per pair are TRL's:
  sigmoid   −(1 − ε)·log σ(βΔ) − ε·log σ(−βΔ)          (DPO; ε > 0 is conservative DPO)
  robust    (−(1 − ε)·log σ(βΔ) + ε·log σ(−βΔ)) / (1 − 2ε)   (robust DPO: unbiased under label noise ε)
  hinge     max(0, 1 − βΔ)                             (SLiC)
  ipo       (Δ − 1/(2β))²                              (IPO, on log-probs averaged over the response's tokens)
The implicit rewards β·(π − π_ref) of each side are what TRL logs as rewards/chosen and rewards/rejected.
With `rpo_alpha` = α > 0 the loss gains α times the chosen responses' negative log-likelihood per token (RPO;
older TRL's `rpo_alpha`, TRL 1.16's loss_type [.., "sft"] with weight α): DPO alone can lower the chosen
answers' likelihood as long as the rejected ones fall faster, which on a task the model mostly answers right
costs greedy accuracy. The mean is over the whole batch's chosen tokens, the same for every layout and
micro-batch size; TRL's equals it for a batch taken in one micro-batch (under gradient accumulation TRL
averages each micro-batch's own mean).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mindrl.algorithms.registry import Registry
from mindrl.config.errors import ConfigError

#: (Δ, β, ε) → per-pair loss
PairLoss = Callable[[torch.Tensor, float, float], torch.Tensor]
DPO_LOSSES: Registry[PairLoss] = Registry("DPO loss", "dpo_loss_type")
#: losses defined on token-averaged log-probs (IPO's length normalisation, as TRL computes it); the rest sum
AVERAGED = frozenset({"ipo"})


@DPO_LOSSES.register("sigmoid")
def sigmoid(delta: torch.Tensor, beta: float, smoothing: float) -> torch.Tensor:
    return -(1 - smoothing) * F.logsigmoid(beta * delta) - smoothing * F.logsigmoid(-beta * delta)


@DPO_LOSSES.register("robust")
def robust(delta: torch.Tensor, beta: float, smoothing: float) -> torch.Tensor:
    return (-(1 - smoothing) * F.logsigmoid(beta * delta) + smoothing * F.logsigmoid(-beta * delta)) / \
        (1 - 2 * smoothing)


@DPO_LOSSES.register("hinge")
def hinge(delta: torch.Tensor, beta: float, smoothing: float) -> torch.Tensor:
    return torch.relu(1 - beta * delta)


@DPO_LOSSES.register("ipo")
def ipo(delta: torch.Tensor, beta: float, smoothing: float) -> torch.Tensor:
    return (delta - 1 / (2 * beta)) ** 2


@dataclass(frozen=True)
class DPOLossConfig:
    """`dpo_loss_type`, `dpo_beta`, `dpo_label_smoothing` (MindSpeed-LLM's and TRL's names) and `rpo_alpha`."""

    dpo_loss_type: str = "sigmoid"
    dpo_beta: float = 0.1
    dpo_label_smoothing: float = 0.0
    #: weight of the chosen responses' token-mean NLL added to the preference loss (RPO)
    rpo_alpha: float = 0.0

    def __post_init__(self) -> None:
        DPO_LOSSES.get(self.dpo_loss_type)
        if not 0.0 <= self.rpo_alpha < float("inf"):
            raise ConfigError(f"rpo_alpha must be a finite weight ≥ 0 (0 leaves the chosen responses' NLL out), "
                              f"got {self.rpo_alpha}.")
        if self.dpo_beta <= 0:
            raise ConfigError(f"dpo_beta must be positive, got {self.dpo_beta}.")
        if not 0.0 <= self.dpo_label_smoothing < 0.5:
            raise ConfigError(f"dpo_label_smoothing must be in [0, 0.5) (the share of pairs whose labels are "
                              f"flipped), got {self.dpo_label_smoothing}.")
        if self.dpo_label_smoothing and self.dpo_loss_type not in ("sigmoid", "robust"):
            raise ConfigError(f"dpo_label_smoothing applies to the sigmoid and robust losses, not "
                              f"{self.dpo_loss_type}; set it to 0 or choose one of them.")

    @property
    def averaged(self) -> bool:
        """Whether the sequence log-probs are token means (IPO) rather than sums."""
        return self.dpo_loss_type in AVERAGED


def dpo_loss(cfg: DPOLossConfig, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the chosen and rejected implicit rewards, from [pairs] sequence log-probs."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    losses = DPO_LOSSES.get(cfg.dpo_loss_type)(chosen_ratio - rejected_ratio, cfg.dpo_beta, cfg.dpo_label_smoothing)
    return losses, cfg.dpo_beta * chosen_ratio.detach(), cfg.dpo_beta * rejected_ratio.detach()


def sequence_log_probs(cfg: DPOLossConfig, token_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[rows] log-probs of each row's response: the sum over its tokens (`mask`), the mean for IPO."""
    total = (token_log_probs * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if cfg.averaged else total


def chosen_nll(token_log_probs: torch.Tensor, mask: torch.Tensor, chosen_tokens: float) -> torch.Tensor:
    """This share of the batch's chosen-response NLL per token: rows 2i are the chosen responses, and
    `chosen_tokens` counts the whole batch's, so shares over micro-batches and ranks sum to TRL's "sft" loss of
    the batch taken at once."""
    return -(token_log_probs[0::2] * mask[0::2]).sum() / max(chosen_tokens, 1.0)


def sequence_chosen_nll(cfg: DPOLossConfig, policy: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """The chosen responses' summed NLL from [rows] sequence log-probs (rows 2i chosen, as `sequence_log_probs`
    gives them) and each one's token count: what held-out pairs are judged by, where no token log-probs are kept."""
    chosen = policy[0::2]
    return -(chosen * chosen_tokens if cfg.averaged else chosen).sum()


def pair_losses(cfg: DPOLossConfig, policy: torch.Tensor,
                reference: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses and TRL's per-pair metrics from [rows] sequence log-probs whose rows 2i and 2i + 1 are pair
    i's chosen and rejected response (`dpo_loss`, `rewards/...`, `logps/...`: their means are what TRL logs)."""
    chosen, rejected = policy.view(-1, 2).unbind(-1)
    losses, chosen_rewards, rejected_rewards = dpo_loss(cfg, chosen, rejected, *reference.view(-1, 2).unbind(-1))
    return losses, {"dpo_loss": losses.detach(), "rewards/chosen": chosen_rewards,
                    "rewards/rejected": rejected_rewards,
                    "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
                    "rewards/margins": chosen_rewards - rejected_rewards, "logps/chosen": chosen.detach(),
                    "logps/rejected": rejected.detach()}
