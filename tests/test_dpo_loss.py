"""The preference losses against hand-computed values, and their gradients against the derivatives of the
published formulas (TRL's DPOTrainer defines each loss type), written out by hand."""

import math

import pytest
import torch

from mindrl.algorithms.dpo_loss import DPO_LOSSES, DPOLossConfig, chosen_nll, dpo_loss, sequence_chosen_nll
from mindrl.config import ConfigError


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# chosen −1 vs its reference −1.5 (+0.5), rejected −3 vs −2.5 (−0.5): Δ = 1
PAIR = (torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-1.5]), torch.tensor([-2.5]))


@pytest.mark.parametrize("loss_type, smoothing, expected", [
    ("sigmoid", 0.0, -math.log(_sig(0.1))),
    ("sigmoid", 0.1, -0.9 * math.log(_sig(0.1)) - 0.1 * math.log(_sig(-0.1))),
    ("robust", 0.1, (-0.9 * math.log(_sig(0.1)) + 0.1 * math.log(_sig(-0.1))) / 0.8),
    ("hinge", 0.0, 0.9),
    ("ipo", 0.0, (1 - 1 / 0.2) ** 2),
])
def test_losses_and_rewards_by_hand(loss_type, smoothing, expected):
    cfg = DPOLossConfig(loss_type, dpo_beta=0.1, dpo_label_smoothing=smoothing)
    losses, chosen, rejected = dpo_loss(cfg, *PAIR)
    assert losses.item() == pytest.approx(expected, rel=1e-6)
    assert (chosen.item(), rejected.item()) == pytest.approx((0.05, -0.05))


def _derivative(loss_type: str, delta: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """d loss / dΔ of each published loss, by hand: σ'(x) = σ(x)σ(−x), d/dx log σ(x) = σ(−x)."""
    s = torch.sigmoid
    if loss_type == "sigmoid":
        return -(1 - eps) * beta * s(-beta * delta) + eps * beta * s(beta * delta)
    if loss_type == "robust":
        return (-(1 - eps) * beta * s(-beta * delta) - eps * beta * s(beta * delta)) / (1 - 2 * eps)
    if loss_type == "hinge":
        return torch.where(1 - beta * delta > 0, -beta * torch.ones_like(delta), torch.zeros_like(delta))
    return 2 * (delta - 1 / (2 * beta))


@pytest.mark.parametrize("loss_type", DPO_LOSSES.names())
def test_gradients_equal_the_published_formulas_derivatives(loss_type):
    gen = torch.Generator().manual_seed(0)
    logps = [(torch.rand(64, generator=gen, dtype=torch.float64) * -20) for _ in range(4)]
    chosen, rejected = (t.clone().requires_grad_() for t in logps[:2])
    eps = 0.2 if loss_type in ("sigmoid", "robust") else 0.0
    cfg = DPOLossConfig(loss_type, dpo_beta=0.3, dpo_label_smoothing=eps)
    losses, _, _ = dpo_loss(cfg, chosen, rejected, logps[2], logps[3])
    losses.sum().backward()
    delta = (logps[0] - logps[2]) - (logps[1] - logps[3])
    expected = _derivative(loss_type, delta, 0.3, eps)
    torch.testing.assert_close(chosen.grad, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rejected.grad, -expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kwargs, message", [
    ({"dpo_loss_type": "kto"}, "unknown DPO loss 'kto' for dpo_loss_type; known: hinge, ipo, robust, sigmoid"),
    ({"dpo_beta": 0.0}, "dpo_beta must be positive"),
    ({"dpo_label_smoothing": 0.5}, r"dpo_label_smoothing must be in \[0, 0.5\)"),
    ({"dpo_loss_type": "ipo", "dpo_label_smoothing": 0.1}, "applies to the sigmoid and robust losses, not ipo"),
    ({"rpo_alpha": float("nan")}, "rpo_alpha must be a finite weight ≥ 0"),
    ({"rpo_alpha": float("inf")}, "rpo_alpha must be a finite weight ≥ 0"),
])
def test_config_mistakes_are_one_sentence(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DPOLossConfig(**kwargs)


def test_chosen_nll_by_hand_sums_to_the_batch_token_mean_over_shares():
    """Rows 0 and 2 are chosen: tokens −1, −2 (masked −9) and −3 → NLL 6 over 3 tokens; the rejected rows'
    −5s never count. Two shares of the batch (micro-batches) with its token count add up to the same 2.0."""
    log_probs = torch.tensor([[-1.0, -2.0, -9.0], [-5.0, -5.0, -5.0], [-3.0, 0.0, 0.0], [-5.0, -5.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert chosen_nll(log_probs, mask, 3.0).item() == 2.0
    assert (chosen_nll(log_probs[:2], mask[:2], 3.0) + chosen_nll(log_probs[2:], mask[2:], 3.0)).item() == 2.0


def test_sequence_chosen_nll_from_summed_and_from_averaged_log_probs():
    """Chosen rows 0 and 2 of 2 and 3 tokens at −4 and −6 in all (IPO's token means −2 and −2): NLL 10 both ways."""
    lengths = torch.tensor([2.0, 3.0])
    summed = torch.tensor([-4.0, -9.0, -6.0, -9.0])
    averaged = torch.tensor([-2.0, -3.0, -2.0, -3.0])
    assert sequence_chosen_nll(DPOLossConfig("sigmoid"), summed, lengths).item() == 10.0
    assert sequence_chosen_nll(DPOLossConfig("ipo"), averaged, lengths).item() == 10.0
