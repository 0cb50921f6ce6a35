"""GSPO (policy_loss: gspo): hand-computed values, and its gradient against the paper's sequence-level
objective, which clips the whole response's geometric-mean ratio as one differentiable number."""

import math

import pytest
import torch

from mindrl.algorithms.policy_loss import LossConfig, actor_loss
from mindrl.config import ConfigError

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def _inputs():
    log_prob = torch.tensor([[math.log(1.1), math.log(1.3), 5.0], [math.log(0.5), -3.0, 7.0]], requires_grad=True)
    return log_prob, torch.zeros(2, 3), torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])


def test_gspo_by_hand():
    # response 0: s = sqrt(1.1 * 1.3) = 1.19583 inside [0.8, 1.2], loss -s per token;
    # response 1: s = 0.5, A = -1: max(0.5, 0.8) = 0.8, clipped (no gradient)
    s0 = math.sqrt(1.1 * 1.3)
    log_prob, old, adv = _inputs()
    cfg = LossConfig(clip_ratio=0.2, policy_loss="gspo")
    loss, metrics = actor_loss(log_prob, old, adv, MASK, cfg)
    assert loss.item() == pytest.approx((-2 * s0 + 0.8) / 3, rel=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)
    grad, = torch.autograd.grad(loss, log_prob)
    assert grad.flatten().tolist() == pytest.approx([-s0 / 3, -s0 / 3, 0.0, 0.0, 0.0, 0.0], rel=1e-6)
    per_response, _ = actor_loss(log_prob, old, adv, MASK, LossConfig(clip_ratio=0.2, policy_loss="gspo",
                                                                      loss_agg_mode="seq-mean-token-mean"))
    assert per_response.item() == pytest.approx((-s0 + 0.8) / 2, rel=1e-6)


def _paper_gspo(log_prob, old, adv, mask, low, high):
    """GSPO as the paper writes it: J = mean_i min(s_i A_i, clip(s_i, 1-low, 1+high) A_i), with the sequence
    ratio s_i = exp(mean over the response of log π - log π_old) differentiated as a whole."""
    s = torch.exp(((log_prob - old) * mask).sum(-1) / mask.sum(-1))
    a = adv[:, 0]
    return -torch.minimum(s * a, s.clamp(1 - low, 1 + high) * a).mean()


@pytest.mark.parametrize("seed", range(3))
def test_gspo_gradient_equals_the_papers_sequence_level_objective(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(16, 9, generator=gen) < 0.8).float()
    mask[:, 0] = 1.0
    old = torch.randn(16, 9, generator=gen) * 0.5 - 2.0
    log_prob = (old + torch.randn(16, 9, generator=gen) * 0.1).requires_grad_()
    adv = torch.randn(16, 1, generator=gen).expand(16, 9).contiguous()  # one advantage per response (GRPO)
    cfg = LossConfig(clip_ratio_low=0.02, clip_ratio_high=0.03, clip_ratio=0.02, policy_loss="gspo",
                     loss_agg_mode="seq-mean-token-mean")
    loss, metrics = actor_loss(log_prob, old, adv, mask, cfg)
    ours, = torch.autograd.grad(loss, log_prob)
    paper = _paper_gspo(log_prob, old, adv, mask, 0.02, 0.03)
    expected, = torch.autograd.grad(paper, log_prob)
    assert loss.item() == pytest.approx(paper.item(), rel=1e-5)
    assert 0 < metrics["clip_fraction"] < 1  # both sides of the clip are exercised
    assert torch.allclose(ours, expected, atol=1e-7, rtol=1e-5)


def test_gspo_refuses_dual_clip_and_unknown_losses_are_named():
    with pytest.raises(ConfigError, match=r"clip_ratio_c .* policy_loss gspo does not clip"):
        LossConfig(policy_loss="gspo", clip_ratio_c=3.0)
    with pytest.raises(ConfigError, match="unknown policy loss 'gpg' for policy_loss; known: gspo, ppo, vanilla"):
        LossConfig(policy_loss="gpg")
