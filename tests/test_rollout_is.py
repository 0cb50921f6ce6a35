"""Truncated importance sampling against hand-computed numbers and a plain-loop oracle."""

import math

import pytest
import torch

from mindrl.algorithms.policy_loss import LossConfig, actor_loss, ppo_clip_loss
from mindrl.algorithms.rollout_is import (
    DEFAULT_THRESHOLD,
    ROLLOUT_IS_MODES,
    RolloutISConfig,
    mismatch_metrics,
    rollout_is_weights,
)
from mindrl.config import ConfigError

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.1, -3.0]])
ENGINE = torch.tensor([[-1.5, -1.0, -9.0], [-1.2, -1.5, -3.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def weights(mode, threshold=DEFAULT_THRESHOLD, old=OLD, engine=ENGINE, mask=MASK):
    return rollout_is_weights(old, engine, mask, RolloutISConfig(mode, threshold))


def test_modes_registered_and_default_threshold():
    assert ROLLOUT_IS_MODES.names() == ["none", "sequence", "token"]
    assert RolloutISConfig().rollout_is == "none" and RolloutISConfig().rollout_is_threshold == 2.0


def test_token_level_by_hand():
    # log ratios: row 0: 0.5, -1.0 (third token masked); row 1: 1.0, 1.4, 0.0
    w = weights("token", 2.0)
    assert w.flatten().tolist() == pytest.approx([math.exp(0.5), math.exp(-1.0), 0.0, 2.0, 2.0, 1.0])
    assert weights("token", 1.5)[0, 0].item() == pytest.approx(1.5)


def test_sequence_level_by_hand():
    # row 0: Σ = -0.5 → e^-0.5 on both response tokens; row 1: Σ = 2.4 → capped at 2
    w = weights("sequence", 2.0)
    assert w.flatten().tolist() == pytest.approx([math.exp(-0.5), math.exp(-0.5), 0.0, 2.0, 2.0, 2.0])
    assert weights("sequence", 20.0)[1].tolist() == pytest.approx([math.exp(2.4)] * 3)


def test_none_is_one_on_the_response():
    assert weights("none").tolist() == MASK.tolist()


def oracle(mode, old, engine, mask, threshold):
    out = []
    for o_row, e_row, m_row in zip(old.tolist(), engine.tolist(), mask.tolist(), strict=True):
        total = sum(o - e for o, e, m in zip(o_row, e_row, m_row, strict=True) if m)
        row = []
        for o, e, m in zip(o_row, e_row, m_row, strict=True):
            if not m:
                row.append(0.0)
            elif mode == "token":
                row.append(min(math.exp(o - e), threshold))
            elif mode == "sequence":
                row.append(min(math.exp(total), threshold))
            else:
                row.append(1.0)
        out.append(row)
    return out


@pytest.mark.parametrize("mode", ["none", "token", "sequence"])
def test_matches_loop_oracle(mode):
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=gen) * 3
    engine = old + torch.randn(6, 9, generator=gen) * 0.3
    mask = (torch.rand(6, 9, generator=gen) > 0.3).float()
    got = rollout_is_weights(old, engine, mask, RolloutISConfig(mode, 1.7))
    assert got.tolist() == [pytest.approx(row, rel=1e-5) for row in oracle(mode, old, engine, mask, 1.7)]


def test_padding_outside_mask_cannot_leak():
    engine = ENGINE.clone()
    engine[0, 2] = -math.inf  # an engine that pads with -inf
    for mode in ("token", "sequence"):
        w = weights(mode, engine=engine)
        assert torch.isfinite(w).all() and w[0, 2] == 0
        assert w.tolist() == weights(mode).tolist()
    assert all(math.isfinite(v) for v in mismatch_metrics(OLD, engine, MASK, RolloutISConfig("token")).values())


def test_huge_sequence_sum_does_not_overflow():
    w = rollout_is_weights(torch.zeros(1, 4), torch.full((1, 4), -500.0), torch.ones(1, 4),
                           RolloutISConfig("sequence", 3.0))
    assert w.tolist() == [[3.0] * 4]


def test_weights_are_detached():
    old = OLD.clone().requires_grad_()
    assert not weights("token", old=old).requires_grad


def test_mismatch_metrics_by_hand():
    # |Δ| over the 5 response tokens: 0.5, 1.0, 1.0, 1.4, 0.0
    m = mismatch_metrics(OLD, ENGINE, MASK, RolloutISConfig("token", 2.0))
    assert m["rollout_is/abs_log_prob_diff_mean"] == pytest.approx(3.9 / 5)
    assert m["rollout_is/abs_log_prob_diff_max"] == pytest.approx(1.4)
    ratios = [0.5, -1.0, 1.0, 1.4, 0.0]
    assert m["rollout_is/k3_kl"] == pytest.approx(sum(math.exp(r) - r - 1 for r in ratios) / 5, rel=1e-6)
    assert m["rollout_is/truncated_frac"] == pytest.approx(2 / 5)  # e^1.0 and e^1.4 exceed 2
    assert m["rollout_is/weight_mean"] == pytest.approx((math.exp(0.5) + math.exp(-1) + 2 + 2 + 1) / 5)
    seq = mismatch_metrics(OLD, ENGINE, MASK, RolloutISConfig("sequence", 2.0))
    assert seq["rollout_is/truncated_frac"] == pytest.approx(3 / 5)  # all of row 1 (Σ = 2.4)
    none = mismatch_metrics(OLD, ENGINE, MASK, RolloutISConfig("none", 2.0))
    assert none["rollout_is/truncated_frac"] == 0 and none["rollout_is/weight_mean"] == 1
    assert none["rollout_is/k3_kl"] == m["rollout_is/k3_kl"]


def test_identical_policies_have_no_mismatch():
    m = mismatch_metrics(OLD, OLD, MASK, RolloutISConfig("sequence", 1.0))
    assert m["rollout_is/abs_log_prob_diff_max"] == 0 and m["rollout_is/k3_kl"] == 0
    assert m["rollout_is/truncated_frac"] == 0 and m["rollout_is/weight_mean"] == 1


def test_config_errors():
    with pytest.raises(ConfigError, match="unknown rollout importance-sampling mode 'tok' for rollout_is; known: "
                                          "none, sequence, token"):
        RolloutISConfig("tok")
    for bad in (0.5, math.inf, math.nan, True, "2"):
        with pytest.raises(ConfigError, match="rollout_is_threshold must be a finite number >= 1"):
            RolloutISConfig("token", bad)
    with pytest.raises(ValueError, match="must have one shape"):
        rollout_is_weights(OLD, ENGINE[:, :2], MASK, RolloutISConfig("token"))


def test_actor_loss_scales_each_token_pg_loss():
    gen = torch.Generator().manual_seed(1)
    log_prob = (-torch.rand(2, 3, generator=gen)).requires_grad_()
    old, adv = -torch.rand(2, 3, generator=gen), torch.randn(2, 3, generator=gen)
    cfg = LossConfig()
    w = weights("token")
    plain, _ = actor_loss(log_prob, old, adv, MASK, cfg)
    ones, _ = actor_loss(log_prob, old, adv, MASK, cfg, is_weights=MASK)
    assert ones.item() == pytest.approx(plain.item())
    loss, metrics = actor_loss(log_prob, old, adv, MASK, cfg, is_weights=w)
    per_token, _ = ppo_clip_loss(log_prob, old, adv, MASK, cfg)
    expected = sum(w[i, j] * per_token[i, j] for i in range(2) for j in range(3) if MASK[i, j]) / MASK.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["pg_loss"] == pytest.approx(expected.item(), rel=1e-6)
    grad_w, = torch.autograd.grad(loss, log_prob)
    grad_plain, = torch.autograd.grad(plain, log_prob)
    assert torch.allclose(grad_w, grad_plain * w, atol=1e-7)
