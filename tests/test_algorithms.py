"""Advantages, policy losses, KL estimators and loss aggregation against hand-computed numbers."""

import math

import pytest
import torch

from mindrl.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from mindrl.algorithms.aggregation import LOSS_AGG_MODES, aggregate
from mindrl.algorithms.kl import KL_ESTIMATORS, kl_divergence, kl_penalized_rewards
from mindrl.algorithms.policy_loss import LossConfig, actor_loss, ppo_clip_loss
from mindrl.config import ConfigError


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


ONE_TOKEN = torch.ones(8, 1)
SCORES = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])  # two prompts, 4 responses each


def test_group_norm():
    # group 1: mean 0.25, unbiased std sqrt((0.75² + 3·0.25²)/3) = 0.5; group 2: std 0 → 0
    adv = compute_advantages("group_norm", SCORES, ONE_TOKEN, 4, eps=1e-12)
    assert adv.squeeze(-1).tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], abs=1e-6)
    assert compute_advantages("group_norm", SCORES, ONE_TOKEN, 4).squeeze(-1)[0] == pytest.approx(0.75 / (0.5 + 1e-6))


def test_group_mean_dr_grpo():
    adv = compute_advantages("group_mean", SCORES, ONE_TOKEN, 4)
    assert adv.squeeze(-1).tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])


def test_rloo():
    adv = compute_advantages("rloo", SCORES, ONE_TOKEN, 4)
    assert adv.squeeze(-1).tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="rloo needs n_samples_per_prompt >= 2"):
        compute_advantages("rloo", SCORES, ONE_TOKEN, 1)


def test_reinforce_plus_plus_baseline():
    # centred [0.75, -0.25 ×3, 0 ×4], whitened over 8 tokens: mean 0, unbiased var 0.75 / 7
    adv = compute_advantages("reinforce_plus_plus_baseline", SCORES, ONE_TOKEN, 4)
    std = math.sqrt(0.75 / 7)
    assert adv.squeeze(-1).tolist() == pytest.approx([0.75 / std] + [-0.25 / std] * 3 + [0.0] * 4, rel=1e-5)


GROUP_CENTRED = ("group_norm", "group_mean", "rloo", "reinforce_plus_plus_baseline")


@pytest.mark.parametrize("name", GROUP_CENTRED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_flat_group_gets_exactly_zero_advantage(name, dtype):
    """Many random flat groups of every size, beside an informative one: every token of a flat group is 0.
    (In float32, -0.9 × 8 gave group_norm +0.056 per token: the mean's rounding over std + eps.)"""
    gen = torch.Generator().manual_seed(0)
    for n in range(2, 17):
        values = torch.cat([torch.tensor([-0.9, 1.2, 0.1, 1.1, -0.5, 1 / 3], dtype=dtype),
                            (torch.rand(40, generator=gen, dtype=torch.float64) * 20 - 10).to(dtype)])
        scores = torch.cat([values.repeat_interleave(n), torch.arange(n, dtype=dtype)])  # last group informative
        mask = (torch.rand(scores.numel(), 7, generator=gen) < 0.8).float()
        mask[:, 0] = 1
        adv = compute_advantages(name, scores, mask, n)
        flat = adv[:-n]
        assert torch.count_nonzero(flat) == 0, (n, flat.abs().max().item())
        assert torch.count_nonzero(adv[-n:]) > 0


def test_reinforce_plus_plus_token_level_returns():
    mask = t([1, 1, 0], [1, 1, 1])
    scores = torch.tensor([1.0, -1.0])
    # returns-to-go with γ=1: [[1, 1, –], [-1, -1, -1]]; whitened: mean -0.2, unbiased var 1.2
    adv = compute_advantages("reinforce_plus_plus", scores, mask, 1)
    std = math.sqrt(1.2)
    expected = [[1.2 / std, 1.2 / std, 0.0], [-0.8 / std] * 3]
    assert adv.tolist() == [pytest.approx(row, rel=1e-5) for row in expected]
    # with γ = 0.5 the returns are [[0.5, 1], [-0.25, -0.5, -1]] before whitening
    raw = compute_advantages("reinforce_plus_plus", scores, mask, 1, gamma=0.5)
    values = torch.tensor([0.5, 1.0, -0.25, -0.5, -1.0])
    expected = ((values - values.mean()) / values.std()).tolist()
    assert raw[mask.bool()].tolist() == pytest.approx(expected, rel=1e-5)


def test_advantages_are_zero_outside_the_mask_and_groups_must_fit():
    mask = t([1, 1, 0, 0], [1, 0, 0, 0])
    for name in ADVANTAGE_ESTIMATORS.names():
        adv = compute_advantages(name, torch.tensor([1.0, 0.0]), mask, 2)
        assert torch.all(adv[mask == 0] == 0), name
    with pytest.raises(ValueError, match="do not form groups of 4"):
        compute_advantages("group_norm", torch.ones(6), torch.ones(6, 1), 4)
    with pytest.raises(ConfigError, match="unknown advantage estimator 'gae' for adv_estimator; known: dr_grpo"):
        compute_advantages("gae", SCORES, ONE_TOKEN, 4)


LP, REF = math.log(0.5), math.log(0.25)  # d = log π − log π_ref = ln 2


@pytest.mark.parametrize("kind, forward, backward", [
    ("k1", math.log(2), -math.log(2)),
    ("kl", math.log(2), -math.log(2)),
    ("abs", math.log(2), math.log(2)),
    ("k2", 0.5 * math.log(2) ** 2, 0.5 * math.log(2) ** 2),
    ("mse", 0.5 * math.log(2) ** 2, 0.5 * math.log(2) ** 2),
    ("k3", 0.5 + math.log(2) - 1, 2 - math.log(2) - 1),          # e^{-d} + d − 1
    ("low_var_kl", 0.5 + math.log(2) - 1, 2 - math.log(2) - 1),
])
def test_kl_estimators(kind, forward, backward):
    assert kl_divergence(torch.tensor([LP]), torch.tensor([REF]), kind).item() == pytest.approx(forward, rel=1e-6)
    assert kl_divergence(torch.tensor([REF]), torch.tensor([LP]), kind).item() == pytest.approx(backward, rel=1e-6)


def test_low_var_kl_clamps():
    lp = torch.tensor([0.0, 0.0, 0.0])
    ref = torch.tensor([30.0, -30.0, 5.0])
    # log-ratio 30 → 20: e^20 − 21 → 10; −30 → −20: e^-20 + 19 → 10; 5: e^5 − 6 = 142.4 → 10
    assert kl_divergence(lp, ref, "k3").tolist() == pytest.approx([10.0, 10.0, 10.0])
    small = kl_divergence(torch.tensor([0.0]), torch.tensor([-2.0]), "k3").item()
    assert small == pytest.approx(math.exp(-2) + 2 - 1)
    assert set(KL_ESTIMATORS.names()) == {"abs", "k1", "k2", "k3", "kl", "low_var_kl", "mse"}


def test_kl_as_a_reward_penalty():
    rewards = kl_penalized_rewards(torch.tensor([1.0, 2.0]), torch.ones(2, 3), t([1, 1, 0], [1, 1, 1]), coef=0.1)
    assert rewards.tolist() == [pytest.approx([-0.1, 0.9, 0.0]), pytest.approx([-0.1, -0.1, 1.9])]


@pytest.mark.parametrize("adv, ratio, expected, clipped", [
    (1.0, 1.5, -1.2, 1.0),   # positive advantage, ratio above 1+ε: clipped at 1.2
    (1.0, 0.5, -0.5, 0.0),   # positive advantage, low ratio: no clip (pessimistic bound is unclipped)
    (-1.0, 1.5, 1.5, 0.0),   # negative advantage, high ratio: unclipped is larger
    (-1.0, 0.5, 0.8, 1.0),   # negative advantage, ratio below 1−ε: clipped at 0.8
    (1.0, 1.0, -1.0, 0.0),   # on-policy
])
def test_ppo_clip(adv, ratio, expected, clipped):
    loss, flags = ppo_clip_loss(torch.tensor([math.log(ratio)]), torch.tensor([0.0]), torch.tensor([adv]),
                                torch.ones(1), LossConfig(clip_ratio=0.2))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert flags["clipped"].item() == clipped


def test_clip_higher_uses_separate_bounds():
    cfg = LossConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)
    losses, _ = ppo_clip_loss(torch.log(torch.tensor([1.25, 1.3, 0.7])), torch.zeros(3), torch.tensor([1.0, 1.0, -1.0]),
                              torch.ones(3), cfg)
    assert losses.tolist() == pytest.approx([-1.25, -1.28, 0.8], rel=1e-6)


def test_dual_clip_caps_negative_advantages_only():
    cfg = LossConfig(clip_ratio=0.2, clip_ratio_c=3.0)
    losses, flags = ppo_clip_loss(torch.log(torch.tensor([5.0, 2.0, 5.0])), torch.zeros(3),
                                  torch.tensor([-1.0, -1.0, 1.0]), torch.ones(3), cfg)
    assert losses.tolist() == pytest.approx([3.0, 2.0, -1.2], rel=1e-6)
    assert flags["dual_clipped"].tolist() == [1.0, 0.0, 0.0]


LOSS = t([1, 2, 3], [4, 0, 0])
MASK = t([1, 1, 1], [1, 0, 0])


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 10 / 4),
    ("seq-mean-token-sum", (6 + 4) / 2),
    ("seq-mean-token-mean", (2 + 4) / 2),
    ("seq-mean-token-sum-norm", 10 / (2 * 3)),
])
def test_aggregation_modes(mode, expected):
    assert aggregate(LOSS, MASK, mode, norm_length=3).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", sorted(LOSS_AGG_MODES.names()))
def test_aggregation_does_not_depend_on_padding(mode):
    """More right-padding (a longer batch) must not change the loss: Dr. GRPO's L is a constant."""
    padded_loss = torch.cat([LOSS, torch.full((2, 5), 7.0)], dim=1)
    padded_mask = torch.cat([MASK, torch.zeros(2, 5)], dim=1)
    assert aggregate(padded_loss, padded_mask, mode, norm_length=3).item() == pytest.approx(
        aggregate(LOSS, MASK, mode, norm_length=3).item())


def test_dr_grpo_norm_length_must_be_given():
    with pytest.raises(ValueError, match="needs norm_length"):
        aggregate(LOSS, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ConfigError, match="loss_agg_mode seq-mean-token-sum-norm needs loss_norm_length"):
        LossConfig(loss_agg_mode="seq-mean-token-sum-norm")
    assert LossConfig(loss_agg_mode="seq-mean-token-sum-norm", loss_norm_length=512).loss_norm_length == 512


def test_aggregation_with_global_normalisers_sums_over_micro_batches():
    for mode in LOSS_AGG_MODES.names():
        whole = aggregate(LOSS, MASK, mode, norm_length=3)
        parts = sum(aggregate(LOSS[i:i + 1], MASK[i:i + 1], mode, num_tokens=MASK.sum(), num_seqs=2, norm_length=3)
                    for i in range(2))
        assert parts.item() == pytest.approx(whole.item()), mode
    assert aggregate(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=5).item() == pytest.approx(1.0)


def test_actor_loss_adds_kl_and_subtracts_entropy():
    mask = t([1, 1])
    log_prob = torch.tensor([[math.log(0.5), math.log(0.5)]])
    cfg = LossConfig(clip_ratio=0.2, use_kl_loss=True, kl_coef=0.1, kl_loss_type="k1", entropy_coeff=0.01)
    loss, metrics = actor_loss(log_prob, log_prob.clone(), t([1.0, -1.0]), mask, cfg,
                               ref_log_prob=torch.full((1, 2), math.log(0.25)), entropy=t([2.0, 4.0]))
    # pg: ratio 1 → [-1, 1] → token-mean 0; kl k1 = ln 2 per token; entropy mean 3
    assert metrics["pg_loss"] == pytest.approx(0.0)
    assert metrics["kl_loss"] == pytest.approx(math.log(2))
    assert metrics["entropy"] == pytest.approx(3.0)
    assert loss.item() == pytest.approx(0.1 * math.log(2) - 0.01 * 3.0)
    with pytest.raises(ValueError, match="use_kl_loss needs the reference"):
        actor_loss(log_prob, log_prob, t([1.0, -1.0]), mask, cfg)


def test_loss_gradient_pushes_log_prob_with_the_advantage():
    for sign in (1.0, -1.0):
        log_prob = torch.tensor([[-1.0]], requires_grad=True)
        loss, _ = actor_loss(log_prob, torch.tensor([[-1.0]]), torch.tensor([[sign]]), torch.ones(1, 1), LossConfig())
        loss.backward()
        assert torch.sign(-log_prob.grad).item() == sign  # gradient descent raises log π iff A > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(loss_agg_mode="mean"), "unknown loss aggregation mode 'mean' for loss_agg_mode; known: seq-mean"),
    (dict(kl_loss_type="k4"), "unknown KL estimator 'k4'"),
    (dict(clip_ratio_low=0.3, clip_ratio_high=0.2), "clip_ratio_low=0.3 exceeds clip_ratio_high=0.2"),
    (dict(clip_ratio=1.5), "0 < clip_ratio_low < 1"),
    (dict(clip_ratio_c=0.9), "clip_ratio_c=0.9 must be > 1"),
])
def test_loss_config_mistakes_are_one_sentence(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LossConfig(**kwargs)
