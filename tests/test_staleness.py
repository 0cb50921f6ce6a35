"""Staleness metrics and the oldest version per sample, against hand-computed numbers."""

import pytest
import torch

from mindrl.algorithms.staleness import oldest_version, staleness_metrics

VERSION = 5
# Outside the mask the versions are padding (-1, 0, 2), which must not count.
VERSIONS = torch.tensor([[5, 5, 4, -1],   # staleness 0, 0, 1: oldest 1, mean 1/3
                         [3, 4, 5, 5],    # 2, 1, 0, 0: oldest 2 (its last token is fresh), mean 3/4
                         [5, 5, 0, 0],    # 0, 0: on-policy
                         [2, 2, 2, 2]])   # no response token: skipped
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
# masked: 1, 0.5, 0 | 2, 1, 0, 1.5 | 1, 2: mean 9/9 = 1, squared deviations sum to 4.5 over 9 tokens
WEIGHTS = torch.tensor([[1.0, 0.5, 0.0, 9.0], [2.0, 1.0, 0.0, 1.5], [1.0, 2.0, 7.0, 7.0], [9.0] * 4])


def test_oldest_version_by_hand():
    assert oldest_version(VERSIONS, MASK).tolist() == [4, 3, 5, torch.iinfo(torch.int64).max]


def test_oldest_version_empty_row_never_looks_stale():
    versions = torch.tensor([[1, 1]], dtype=torch.int32)
    oldest = oldest_version(versions, torch.zeros(1, 2))
    assert oldest.tolist() == [torch.iinfo(torch.int32).max] and (VERSION - oldest <= 0).all()


def test_staleness_by_hand():
    assert staleness_metrics(VERSIONS, MASK, VERSION) == pytest.approx({
        "async/staleness_mean": 4 / 9,               # (1 + 3 + 0) over 9 tokens
        "async/staleness_max": 2.0,
        "async/staleness_oldest_token_mean": 1.0,    # (1 + 2 + 0) / 3 samples
        "async/staleness_sample_mean": 13 / 36,      # (1/3 + 3/4 + 0) / 3
        "async/off_policy_token_share": 3 / 9,
        "async/off_policy_sample_share": 2 / 3,
    })


def test_is_weight_spread_and_the_gap_are_the_stale_tokens_by_hand():
    # the stale tokens: row 0's third (weight 0.0), row 1's first two (2.0, 1.0); the fresh ones' weights and gaps
    # are the engine/trainer mismatch, reported as rollout_is/*
    gap = torch.tensor([[9.0, 9.0, -0.5, 9.0], [0.25, -1.0, 9.0, 9.0], [9.0] * 4, [9.0] * 4])
    metrics = staleness_metrics(VERSIONS, MASK, VERSION, is_weights=WEIGHTS, log_prob_gap=gap)
    assert {k: v for k, v in metrics.items() if "is_weight" in k or "diff" in k} == pytest.approx({
        "async/is_weight_mean": 1.0,
        "async/is_weight_std": (2 / 3) ** 0.5,
        "async/is_weight_min": 0.0,
        "async/is_weight_max": 2.0,
        "async/is_weight_masked_share": 1 / 3,
        "async/stale_abs_log_prob_diff_mean": 1.75 / 3,
    })


def test_single_token_has_no_spread():
    metrics = staleness_metrics(torch.tensor([[4]]), torch.ones(1, 1), 5, is_weights=torch.tensor([[1.5]]))
    assert metrics["async/is_weight_std"] == 0.0 and metrics["async/staleness_oldest_token_mean"] == 1.0


def test_empty_batch_is_all_zeros_and_a_fresh_one_has_no_stale_figures():
    metrics = staleness_metrics(VERSIONS, torch.zeros_like(MASK), VERSION, is_weights=WEIGHTS)
    assert len(metrics) == 6 and set(metrics.values()) == {0.0}
    fresh = staleness_metrics(torch.full((2, 3), VERSION), torch.ones(2, 3), VERSION, WEIGHTS[:2, :3],
                              torch.ones(2, 3))
    assert sorted(fresh) == sorted(staleness_metrics(VERSIONS, MASK, VERSION)) and set(fresh.values()) == {0.0}


def test_newer_than_the_update_is_refused():
    with pytest.raises(ValueError, match="newer"):
        staleness_metrics(VERSIONS, MASK, 4)
