"""PPO's estimator and critic loss against hand-computed numbers: GAE (masks, lengths, the last token,
Monte-Carlo and one-step TD), the clipped value loss, the adaptive KL controller, explained variance."""

from itertools import pairwise

import pytest
import torch

from mindrl.algorithms.advantages import masked_whiten
from mindrl.algorithms.gae import explained_variance, gae_advantages
from mindrl.algorithms.kl import KLController, kl_penalized_rewards
from mindrl.algorithms.value_loss import ValueLossConfig, value_loss
from mindrl.config import ConfigError
from mindrl.trainer.rl import RLConfig

# row 0: prompt at 0-1, response at 2-4, padding at 5; row 1: prompt at 0, response at 1-2, padding after.
# The values on prompt and padding positions are junk the estimate must not read.
MASK = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]], dtype=torch.float32)
VALUES = torch.tensor([[9.0, 9.0, 1.0, 2.0, 3.0, 7.0], [5.0, 0.5, 0.5, 4.0, 4.0, 4.0]])
SCORES = torch.tensor([1.0, -1.0])


def _rewards() -> torch.Tensor:
    return kl_penalized_rewards(SCORES, torch.zeros_like(MASK), MASK, 0.0)


def _raw(gamma: float, lam: float) -> torch.Tensor:
    """The unwhitened advantages, recovered from the returns (returns = advantages + values)."""
    _, returns = gae_advantages(_rewards(), VALUES, MASK, gamma, lam)
    return (returns - VALUES) * MASK


def test_the_score_is_the_reward_of_each_responses_last_token():
    assert _rewards().tolist() == [[0, 0, 0, 0, 1, 0], [0, 0, -1, 0, 0, 0]]


@pytest.mark.parametrize("gamma, lam, row0, row1, returns0", [
    # γ = λ = 1: Monte-Carlo return (the score) minus the value
    (1.0, 1.0, [0.0, -1.0, -2.0], [-1.5, -1.5], [1.0, 1.0, 1.0]),
    # λ = 0: the one-step TD error r_t + γ V_{t+1} − V_t, V past the last token 0
    (1.0, 0.0, [1.0, 1.0, -2.0], [0.0, -1.5], [2.0, 3.0, 1.0]),
    # γ = λ = 0.5: δ = [0, −0.5, −2], A_4 = −2, A_3 = −0.5 + 0.25·(−2) = −1, A_2 = 0 + 0.25·(−1)
    (0.5, 0.5, [-0.25, -1.0, -2.0], [-0.25 - 0.25 * 1.5, -1.5], [0.75, 1.0, 1.0]),
])
def test_gae_by_hand(gamma, lam, row0, row1, returns0):
    raw = _raw(gamma, lam)
    assert raw[0, 2:5].tolist() == pytest.approx(row0)
    assert raw[1, 1:3].tolist() == pytest.approx(row1)
    _, returns = gae_advantages(_rewards(), VALUES, MASK, gamma, lam)
    assert returns[0, 2:5].tolist() == pytest.approx(returns0)
    assert (returns * (1 - MASK)).abs().sum() == 0


def test_advantages_are_whitened_over_the_batchs_response_tokens():
    advantages, returns = gae_advantages(_rewards(), VALUES, MASK, 1.0, 1.0)
    raw = torch.tensor([0.0, -1.0, -2.0, -1.5, -1.5])  # mean −1.2, unbiased variance 2.3 / 4
    expected = (raw + 1.2) / (2.3 / 4) ** 0.5
    assert advantages[MASK.bool()].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    assert (advantages * (1 - MASK)).abs().sum() == 0
    assert torch.allclose(advantages, masked_whiten((returns - VALUES) * MASK, MASK), atol=1e-6)


def _verl_gae(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float,
              lam: float) -> torch.Tensor:
    """verl's published compute_gae_advantage_return (before whitening) on response-aligned rows: the response
    starts at column 0, padding after it, values zeroed on the padding as its critic does."""
    values = values * response_mask
    last, out = torch.zeros(rewards.shape[0], dtype=torch.float64), []
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t < rewards.shape[1] - 1 else 0.0
        last = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * last
        out.append(last)
    return torch.stack(out[::-1], dim=1)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.9), (0.9, 0.0)])
def test_gae_equals_verls_formula_on_random_rollouts(gamma, lam):
    gen = torch.Generator().manual_seed(0)
    rows, prompt, width = 6, 4, 12
    lengths = torch.randint(1, width - prompt + 1, (rows,), generator=gen)
    mask = torch.zeros(rows, width)
    for row, length in enumerate(lengths.tolist()):
        mask[row, prompt:prompt + length] = 1
    values, kl = torch.randn(rows, width, generator=gen), torch.rand(rows, width, generator=gen)
    rewards = kl_penalized_rewards(torch.randn(rows, generator=gen), kl, mask, 0.05)
    _, returns = gae_advantages(rewards, values, mask, gamma, lam)
    ours = ((returns - values) * mask)[:, prompt:].double()
    response_mask = mask[:, prompt:].double()
    theirs = _verl_gae((rewards * mask)[:, prompt:].double(), values[:, prompt:].double(), response_mask, gamma, lam)
    assert torch.allclose(ours, theirs * response_mask, atol=1e-5)


# (value, old value, return) → (loss term before the ½, clipped error chosen)
@pytest.mark.parametrize("v, old, ret, error, clipped", [
    (1.1, 1.0, 2.0, 0.81, False),    # inside the range: both errors agree
    (1.5, 1.0, 2.0, 0.64, True),     # moved towards the return past the range: the clipped, larger error counts
    (0.5, 1.0, 2.0, 2.25, False),    # moved away from the return: its own error is the larger
    (-0.5, 0.0, -1.0, 0.64, True),   # the same, below zero
    (0.3, 0.0, -1.0, 1.69, False),
])
def test_value_loss_clipping_by_hand(v, old, ret, error, clipped):
    cfg = ValueLossConfig(cliprange_value=0.2)
    loss, metrics = value_loss(torch.tensor([[v]]), torch.tensor([[old]]), torch.tensor([[ret]]), torch.ones(1, 1),
                               cfg)
    assert loss.item() == pytest.approx(0.5 * error)
    assert metrics["vf_clipfrac"] == float(clipped) and metrics["vpred_mean"] == pytest.approx(v)


def test_value_loss_gradient_and_aggregation():
    v = torch.tensor([[1.5, 1.1, 9.0]], requires_grad=True)
    old, ret, mask = torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[2.0, 2.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = value_loss(v, old, ret, mask, ValueLossConfig(cliprange_value=0.2), num_tokens=4)
    loss.backward()
    # token 0 is clipped (its loss is constant in v), token 1 is not: d/dv ½(v − R)²/4 = (1.1 − 2)/4; token 2 masked
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81) / 4)
    assert v.grad[0].tolist() == pytest.approx([0.0, (1.1 - 2.0) / 4, 0.0])


def test_value_loss_config_mistakes():
    with pytest.raises(ConfigError, match="cliprange_value must be positive"):
        ValueLossConfig(cliprange_value=0.0)
    with pytest.raises(ConfigError, match="unknown loss aggregation mode"):
        ValueLossConfig(loss_agg_mode="mean")


def test_adaptive_kl_controller_moves_towards_the_target_and_fixed_does_not():
    adaptive = KLController("adaptive", 0.1, target=1.0, horizon=10)
    adaptive.update(3.0, n_steps=4)  # error clipped to +0.2: × (1 + 0.2 · 4 / 10)
    assert adaptive.value == pytest.approx(0.108)
    adaptive.update(0.9, n_steps=4)  # error −0.1: × (1 − 0.1 · 4 / 10)
    assert adaptive.value == pytest.approx(0.108 * 0.96)
    restored = KLController("adaptive", 0.1, target=1.0, horizon=10)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value
    fixed = KLController("fixed", 0.1, target=1.0, horizon=10)
    fixed.update(3.0, n_steps=4)
    assert fixed.value == 0.1


def test_the_adaptive_kl_coefficient_follows_the_kl_with_the_default_target():
    """With rl_config's defaults the coefficient rises while the mean per-token KL is above the target and falls
    while it is below: the quantity it is fed (low_var_kl, at most 10) can reach the default target."""
    rl = RLConfig()
    ctrl = KLController("adaptive", rl.init_kl_coef, rl.kl_target, rl.kl_horizon)
    series = [0.5, 0.3, 0.15, rl.kl_target, 0.05, 0.0]  # a run drifting away from the reference, then back
    values = [ctrl.value]
    for kl in series:
        ctrl.update(kl, n_steps=512)
        values.append(ctrl.value)
    moves = [after - before for before, after in pairwise(values)]
    assert all(m > 0 for m in moves[:3]) and moves[3] == 0 and all(m < 0 for m in moves[4:]), values
    # the first step by hand: error clip(0.5 / 0.1 − 1, ±0.2) = 0.2, × (1 + 0.2 · 512 / 10000)
    assert values[1] == pytest.approx(rl.init_kl_coef * (1 + 0.2 * 512 / rl.kl_horizon))


def test_explained_variance():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0, abs=1e-5)
    assert explained_variance(returns, torch.full_like(returns, 2.0), mask) == pytest.approx(0.0, abs=1e-5)
    # residuals [−2, 0, 2] against returns of variance 1: 1 − 4/1
    assert explained_variance(returns, torch.tensor([[3.0, 2.0, 1.0, 0.0]]), mask) == pytest.approx(-3.0, abs=1e-4)
