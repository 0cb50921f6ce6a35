"""DAPO dynamic sampling: which groups stay, and how rounds fill a batch."""

import random

import pytest
import torch

from mindrl.algorithms.group_filter import GroupAccumulator, kept_groups, select_filter_values


def test_kept_groups_by_hand():
    values = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, -0.5, -1.0, -0.5])
    assert kept_groups(values, 3).tolist() == [False, True, False, True]
    assert kept_groups(values, 2).tolist() == [False, True, True, False, True, True]
    with pytest.raises(ValueError, match="12 filter values do not form groups of 5"):
        kept_groups(values, 5)


def test_kept_groups_matches_loop_oracle():
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(2, 5)
        values = [float(rng.choice([0, 1])) for _ in range(n * rng.randint(1, 8))]
        expected = [len(set(values[g:g + n])) > 1 for g in range(0, len(values), n)]
        assert kept_groups(torch.tensor(values), n).tolist() == expected


def round_batch(first_prompt, prompts, n, width):
    ids = torch.arange(first_prompt, first_prompt + prompts).repeat_interleave(n)
    return {"prompt_id": ids, "tokens": ids.unsqueeze(-1).repeat(1, width),
            "text": [f"p{int(i)}" for i in ids]}


def test_accumulator_fills_in_generation_order_and_drops_surplus():
    acc = GroupAccumulator(target_groups=3, group_size=2, max_batches=5)
    # round 1: prompts 0..3, only prompt 1 informative
    assert not acc.add(round_batch(0, 4, 2, width=3), torch.tensor([1., 1., 0., 1., 0., 0., 1., 1.]))
    # round 2: prompts 10..13, prompts 10, 12, 13 informative: 10 and 12 fill the batch, 13 is surplus
    assert acc.add(round_batch(10, 4, 2, width=5), torch.tensor([0., 1., 1., 1., 1., 0., 0., 1.]))
    batch = acc.batch(pad_values={"tokens": -1})
    assert batch["prompt_id"].tolist() == [1, 1, 10, 10, 12, 12]
    assert batch["text"] == ["p1", "p1", "p10", "p10", "p12", "p12"]
    assert batch["tokens"].tolist() == [[1, 1, 1, -1, -1]] * 2 + [[10] * 5] * 2 + [[12] * 5] * 2
    assert acc.metrics() == {"filter_groups/num_gen_batches": 2.0, "filter_groups/kept_groups": 3.0,
                             "filter_groups/dropped_groups": 4.0, "filter_groups/surplus_groups": 1.0,
                             "filter_groups/kept_frac": 3 / 8, "filter_groups/informative_frac": 0.5}


def test_kept_groups_are_the_batch_and_the_counts_add_up():
    """Three informative groups for a batch of two: two kept, one surplus, none dropped as flat (the count
    of kept groups once took in the surplus)."""
    acc = GroupAccumulator(target_groups=2, group_size=2, max_batches=0)
    assert acc.add(round_batch(0, 3, 2, width=1), torch.tensor([0., 1., 0., 1., 0., 1.]))
    metrics = acc.metrics()
    assert len(acc.batch()["prompt_id"]) == 2 * 2
    assert (metrics["filter_groups/kept_groups"], metrics["filter_groups/dropped_groups"],
            metrics["filter_groups/surplus_groups"]) == (2.0, 0.0, 1.0)
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        target = int(torch.randint(1, 6, (), generator=gen))
        acc = GroupAccumulator(target_groups=target, group_size=3, max_batches=0)
        rounds = 0
        while not acc.done:
            acc.add(round_batch(10 * rounds, 4, 3, width=1), torch.randint(0, 2, (12,), generator=gen).float())
            rounds += 1
        m = acc.metrics()
        assert m["filter_groups/kept_groups"] == target == len(acc.batch()["prompt_id"]) / 3
        assert m["filter_groups/kept_groups"] + m["filter_groups/dropped_groups"] + \
            m["filter_groups/surplus_groups"] == 4 * rounds


def test_the_default_round_limit_survives_an_uninformative_first_round():
    """DAPO with the default filter_groups_max_batches: a first round of flat groups (common early and late in
    training) is followed by more rounds, as DAPO's recipe allows 10; a limit of 1 stopped such a run."""
    from mindrl.trainer.rl import RLConfig

    acc = GroupAccumulator(target_groups=2, group_size=2, max_batches=RLConfig().filter_groups_max_batches)
    for start in range(0, 8, 2):
        acc.add(round_batch(start, 2, 2, width=1), torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert acc.add(round_batch(9, 2, 2, width=1), torch.tensor([0.0, 1.0, 1.0, 0.0]))


def test_exhaustion_names_the_key():
    acc = GroupAccumulator(target_groups=2, group_size=2, max_batches=2, metric="acc")
    flat = torch.tensor([1.0, 1.0, 0.0, 0.0])
    acc.add(round_batch(0, 2, 2, width=1), flat)
    with pytest.raises(ValueError, match=r"^after 2 generation batches only 0 of 2 prompt groups had acc values "
                                         r"that differ within the group; raise filter_groups_max_batches"):
        acc.add(round_batch(2, 2, 2, width=1), flat)


def test_unlimited_rounds_and_early_batch():
    acc = GroupAccumulator(target_groups=1, group_size=2, max_batches=0)
    for start in range(5):
        acc.add(round_batch(start, 1, 2, width=1), torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="holds 0 of 1 prompt groups; call add"):
        acc.batch()
    assert acc.add(round_batch(9, 1, 2, width=1), torch.tensor([0.0, 1.0]))
    assert acc.batch()["prompt_id"].tolist() == [9, 9]
    assert acc.metrics()["filter_groups/num_gen_batches"] == 6


def test_accumulator_checks():
    with pytest.raises(ValueError, match="needs n_samples_per_prompt >= 2"):
        GroupAccumulator(target_groups=1, group_size=1)
    acc = GroupAccumulator(target_groups=1, group_size=2)
    with pytest.raises(ValueError, match="column 'tokens' has 2 rows but there are 4 filter values"):
        acc.add({"tokens": torch.zeros(2, 3)}, torch.tensor([0.0, 1.0, 0.0, 1.0]))


def test_select_filter_values():
    scores, acc = torch.tensor([0.5, 1.0]), torch.tensor([0.0, 1.0])
    verifiers = {"acc": acc, "format": torch.ones(2)}
    assert select_filter_values("acc", scores, verifiers) is acc
    assert select_filter_values("acc_rewards/mean", scores, verifiers) is acc
    assert select_filter_values("score", scores, verifiers) is scores
    with pytest.raises(ValueError, match="filter_groups_metric 'base_acc' is neither 'score' nor a verifier of this "
                                         r"run \(acc, format\); set it to one of them"):
        select_filter_values("base_acc", scores, verifiers)
