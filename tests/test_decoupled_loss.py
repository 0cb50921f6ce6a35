"""Decoupled PPO's behaviour weights by hand, and its gradient against AReaL's published loss."""

import math

import pytest
import torch

from mindrl.algorithms.decoupled import MAX_LOG_WEIGHT, behaviour_weights, correction_weights
from mindrl.algorithms.policy_loss import LossConfig, actor_loss
from mindrl.algorithms.rollout_is import RolloutISConfig, rollout_is_weights
from mindrl.config import ConfigError

# log w = old − engine: row 0: 0.5, -1.0, 2.0, (padding: engine -inf, masked out); row 1: 1.0, 1.4, 0.0, 0.2
OLD = torch.tensor([[-1.0, -2.0, -0.5, -1.0], [-0.2, -0.1, -3.0, -1.0]], dtype=torch.float64)
ENGINE = torch.tensor([[-1.5, -1.0, -2.5, -math.inf], [-1.2, -1.5, -3.0, -1.2]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
E = math.e


def weights(mode, threshold=2.0, cap=None, old=OLD, engine=ENGINE, mask=MASK):
    return behaviour_weights(old, engine, mask, RolloutISConfig(mode, threshold), cap).tolist()


def approx(rows):
    return [pytest.approx(row, rel=1e-12) for row in rows]


def test_none_is_the_plain_behaviour_weight():
    assert weights("none") == approx([[E ** 0.5, E ** -1, E ** 2, 0.0], [E, E ** 1.4, 1.0, E ** 0.2]])


def test_none_with_cap_drops_tokens_above_it():
    # cap 4: e^2 = 7.39 and e^1.4 = 4.06 exceed it and go to 0; e = 2.72 stays
    assert weights("none", cap=4.0) == approx([[E ** 0.5, E ** -1, 0.0, 0.0], [E, 0.0, 1.0, E ** 0.2]])


def test_token_truncates_at_the_threshold():
    # threshold 2: e^2, e and e^1.4 are cut to 2
    assert weights("token") == approx([[E ** 0.5, E ** -1, 2.0, 0.0], [2.0, 2.0, 1.0, E ** 0.2]])


def test_token_with_cap_drops_before_truncating():
    # cap 4 drops e^2 and e^1.4; threshold 2 then cuts e = 2.72 to 2
    assert weights("token", cap=4.0) == approx([[E ** 0.5, E ** -1, 0.0, 0.0], [2.0, 0.0, 1.0, E ** 0.2]])


def test_sequence_is_the_product_truncated():
    # threshold 5: row 0: Σ = 0.5 - 1 + 2 = 1.5, e^1.5 = 4.48 stays; row 1: Σ = 2.6, e^2.6 = 13.5 -> 5
    assert weights("sequence", 5.0) == approx([[E ** 1.5] * 3 + [0.0], [5.0] * 4])


def test_sequence_with_cap_multiplies_the_kept_tokens_only():
    # cap 4 drops row 0's 2.0 and row 1's 1.4: row 0: Σ = -0.5; row 1: Σ = 1.0 + 0.0 + 0.2 = 1.2 (3.32 < 5)
    assert weights("sequence", 5.0, cap=4.0) == approx([[E ** -0.5, E ** -0.5, 0.0, 0.0],
                                                        [E ** 1.2, 0.0, E ** 1.2, E ** 1.2]])


def test_weight_equal_to_the_cap_is_kept():
    old = torch.tensor([[math.log(4.0), 0.0]], dtype=torch.float64)
    engine = torch.zeros(1, 2, dtype=torch.float64)
    assert weights("none", cap=4.0, old=old, engine=engine, mask=torch.ones(1, 2)) == approx([[4.0, 1.0]])


@pytest.mark.parametrize("mode", ["none", "token", "sequence"])
@pytest.mark.parametrize("cap", [None, 4.0])
def test_huge_ratios_stay_finite_and_detached(mode, cap):
    old = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]], requires_grad=True)
    engine = torch.tensor([[-math.inf, -1e30, -1.0], [-1000.0, -0.2, -math.inf]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w = behaviour_weights(old, engine, mask, RolloutISConfig(mode, 3.0), cap)
    assert torch.isfinite(w).all() and not w.requires_grad and w.dtype == torch.float32
    assert w[1, 2].item() == 0.0
    if cap is not None:  # every huge ratio is above the cap
        assert w[0, :2].tolist() == [0.0, 0.0] and w[1, 0].item() == 0.0
    elif mode == "none":
        assert w[0, 0].item() == pytest.approx(math.exp(MAX_LOG_WEIGHT))


def test_low_precision_inputs_give_float32():
    w = behaviour_weights(OLD.bfloat16(), OLD.bfloat16(), MASK, RolloutISConfig("none"))
    assert w.dtype == torch.float32 and w.tolist() == MASK.tolist()


@pytest.mark.parametrize("cap", [0.5, math.inf, True, "2"])
def test_cap_must_be_a_finite_number_of_at_least_one(cap):
    with pytest.raises(ConfigError, match="behav_imp_weight_cap"):
        behaviour_weights(OLD, ENGINE, MASK, RolloutISConfig(), cap)


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="one shape"):
        behaviour_weights(OLD, ENGINE[:, :3], MASK, RolloutISConfig())


def areal_decoupled_loss(log_prob, prox, behav, adv, mask, eps, cap):
    """AReaL's decoupled PPO loss as published, written independently of mindrl's code."""
    ratio = torch.exp(log_prob - prox)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
    behav_weight = torch.exp(prox - behav)
    keep = mask.bool() if cap is None else mask.bool() & (behav_weight <= cap)
    per_token = torch.where(keep, -behav_weight * surrogate, 0.0)
    return per_token.sum() / mask.sum()


@pytest.mark.parametrize("cap", [None, 1.5])
def test_gradient_matches_areal_decoupled_ppo(cap):
    gen = torch.Generator().manual_seed(0)
    shape = (6, 9)
    prox = -torch.rand(shape, generator=gen, dtype=torch.float64) * 3
    behav = prox + torch.randn(shape, generator=gen, dtype=torch.float64) * 0.8
    current = prox + torch.randn(shape, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = (torch.rand(shape, generator=gen) > 0.25).double()
    padded = behav.masked_fill(mask == 0, -math.inf)  # padding the engine may leave outside the response
    above_cap = (mask > 0) & (prox - behav > math.log(1.5))
    assert above_cap.sum() >= 3 and (mask == 0).sum() >= 3

    ours_in = current.clone().requires_grad_(True)
    weights = behaviour_weights(prox, padded, mask, RolloutISConfig("none"), cap)
    ours, _ = actor_loss(ours_in, prox, adv, mask, LossConfig(clip_ratio=0.2), is_weights=weights)
    ours.backward()

    ref_in = current.clone().requires_grad_(True)
    ref = areal_decoupled_loss(ref_in, prox, behav, adv, mask, 0.2, cap)
    ref.backward()

    assert ours.item() == pytest.approx(ref.item(), abs=1e-12)
    assert (ours_in.grad - ref_in.grad).abs().max().item() <= 1e-6
    if cap is not None:  # dropped tokens carry no gradient
        assert ours_in.grad[above_cap].abs().max().item() == 0.0


@pytest.mark.parametrize("mode", ["none", "token", "sequence"])
def test_a_synchronous_batch_is_weighted_as_colocated_wherever_its_engines_run(mode):
    """Every token sampled by the weights being updated (staleness 0, engines on devices of their own): the loss and
    its gradient are the colocated synchronous step's bit for bit, though the engine's log-probs differ from the
    actor's. With rollout_is none the decoupled behaviour weight (the old rule: π_prox/π_engine on every token,
    untruncated) moved them."""
    gen = torch.Generator().manual_seed(1)
    shape = (4, 7)
    old = -torch.rand(shape, generator=gen, dtype=torch.float64) * 3
    engine = old + torch.randn(shape, generator=gen, dtype=torch.float64) * 0.3
    current = old + torch.randn(shape, generator=gen, dtype=torch.float64) * 0.1
    adv = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = (torch.rand(shape, generator=gen) > 0.2).double()
    cfg = RolloutISConfig(mode)
    colocated = None if mode == "none" else rollout_is_weights(old, engine, mask, cfg)
    placed = correction_weights(old, engine, mask, cfg, torch.full(shape, 3), 3, use_decoupled_loss=True)
    assert (placed is None) == (colocated is None)
    grads = []
    for is_weights in (colocated, placed, behaviour_weights(old, engine, mask, cfg)):
        log_prob = current.clone().requires_grad_(True)
        loss, _ = actor_loss(log_prob, old, adv, mask, LossConfig(clip_ratio=0.2), is_weights=is_weights)
        loss.backward()
        grads.append(log_prob.grad)
    assert torch.equal(grads[0], grads[1])
    if mode == "none":  # the old rule's uncapped weight changed the objective; truncated ones it merely repeated
        assert (grads[2] - grads[0]).abs().max() > 1e-3


def test_only_responses_with_an_older_token_get_the_behaviour_weight():
    versions = torch.tensor([[4, 4, 4, 4], [3, 3, 4, 4]])  # row 0 sampled by version 4 (being updated), row 1 not
    for mode in ("none", "token"):
        cfg = RolloutISConfig(mode)
        got = correction_weights(OLD, ENGINE, MASK, cfg, versions, 4, use_decoupled_loss=True, cap=3.0)
        fresh = MASK[0] if mode == "none" else rollout_is_weights(OLD, ENGINE, MASK, cfg)[0]
        assert got[0].tolist() == fresh.tolist()
        assert got[1].tolist() == behaviour_weights(OLD, ENGINE, MASK, cfg, 3.0)[1].tolist()
        # without use_decoupled_loss every response gets the synchronous treatment
        plain = correction_weights(OLD, ENGINE, MASK, cfg, versions, 4, use_decoupled_loss=False)
        assert (plain is None) if mode == "none" else plain.tolist() == rollout_is_weights(OLD, ENGINE, MASK,
                                                                                            cfg).tolist()
