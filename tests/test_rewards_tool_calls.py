"""Rule rewards that see a multi-turn sample's number of tool calls: the two built-ins, the counts' way from the
trainer to the verifier processes, and which custom verifiers get them."""

import textwrap
from types import SimpleNamespace

import pytest
import torch

from mindrl.config import ConfigError
from mindrl.config.reward import RewardConfig
from mindrl.rewards import RewardScorer, get_verifier
from mindrl.trainer.metrics import rollout_metrics
from mindrl.trainer.rewards import Rewards, RuleRewards, ScorerActor

BOXED_5 = "\\boxed{5}"  # 9 characters


@pytest.mark.parametrize("tool_calls", [0, 1, 5])
def test_the_bonus_is_the_number_of_calls_or_verls_flag(tool_calls):
    assert get_verifier("tool_call_bonus")(BOXED_5, "5", tool_calls=tool_calls) == float(tool_calls)
    assert get_verifier("tool_use_bonus")(BOXED_5, "5", tool_calls=tool_calls) == float(tool_calls > 0)


@pytest.mark.parametrize("response, label, tool_calls, expected", [
    (BOXED_5, "5", 0, 1.0),
    (BOXED_5, "5", 7, 1.0),                   # right is 1.0 however many calls
    ("\\boxed{4}", "5", 0, -1.0),
    ("\\boxed{4}", "5", 3, -0.7),             # -1 + 0.1 · 3
    ("\\boxed{4}", "5", 10, 0.0),
    ("\\boxed{4}", "5", 12, 0.0),             # capped: a wrong answer earns nothing
    ("no answer", "5", 3, -0.7),
    (BOXED_5 + "x" * 91, "5", 0, 1.0),        # the box is inside the last 100 characters
    (BOXED_5 + "x" * 92, "5", 0, -1.0),       # its backslash is not
    (BOXED_5 + "x" * 92, "5", 3, -0.7),
])
def test_retool_reward(response, label, tool_calls, expected):
    assert get_verifier("retool_reward")(response, label, tool_calls=tool_calls) == expected


def test_accuracy_counts_only_a_right_retool_answer():
    retool = get_verifier("retool_reward")
    scores = [retool(BOXED_5, "5", tool_calls=0), retool("\\boxed{4}", "5", tool_calls=12),
              retool("\\boxed{4}", "5", tool_calls=3)]
    assert scores == [1.0, 0.0, -0.7]
    metrics = rollout_metrics([1, 1, 1], 4, scores, {"tool_call_bonus": [0.0, 12.0, 3.0], "retool_reward": scores})
    assert metrics["accuracy"] == pytest.approx(1 / 3)


# --- the counts' way to the verifier processes -------------------------------------------------------------------

RESPONSES, LABELS = [BOXED_5, "\\boxed{4}", "no answer"], ["5", "7", "5"]  # the pool groups samples by label


@pytest.mark.parametrize("parallel", [1, 2])
def test_the_counts_reach_the_verifier_processes(parallel):
    config = RewardConfig(verifier_function=["retool_reward", "tool_call_bonus"], verifier_weight=[1.0, 0.1],
                          verifier_parallel=parallel)
    actor = ScorerActor(config)  # what each Ray scorer runs, here in this process
    try:
        result = actor.score(RESPONSES, LABELS, [1, 1, 1], tool_calls=[0, 2, 5])
        single_turn = actor.score(RESPONSES, LABELS, [1, 1, 1])
    finally:
        actor.close()
    assert result.scores == {"retool_reward": [1.0, -0.8, -0.5], "tool_call_bonus": [0.0, 2.0, 5.0]}
    assert result.rewards == pytest.approx([1.0, -0.6, 0.0])
    assert single_turn.rewards == [1.0, -1.0, -1.0]


def test_the_trainer_hands_each_scorer_its_part_of_the_counts():
    calls = []
    scorer = SimpleNamespace(score=SimpleNamespace(remote=lambda *args: calls.append(args)))
    rule = RuleRewards.__new__(RuleRewards)  # two scorers, without Ray
    rule.actors = [scorer, scorer]
    rewards = Rewards(rule, None)
    batch = {"response_lengths": torch.tensor([3, 4, 5])}
    rewards.submit(RESPONSES, LABELS, batch, tool_calls=[0, 2, 5])
    rewards.submit(RESPONSES, LABELS, batch)
    assert calls == [([BOXED_5], ["5"], [3], [0]), (["\\boxed{4}", "no answer"], ["7", "5"], [4, 5], [2, 5]),
                     ([BOXED_5], ["5"], [3], None), (["\\boxed{4}", "no answer"], ["7", "5"], [4, 5], None)]


def test_one_count_per_response():
    with RewardScorer(RewardConfig(verifier_function=["tool_call_bonus"], verifier_weight=[0.1])) as scorer, \
            pytest.raises(ValueError, match="3 responses but 2 tool-call counts; give one count each"):
        scorer.score(RESPONSES, LABELS, tool_calls=[1, 2])


# --- custom verifiers ---------------------------------------------------------------------------------------------

@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "counted_rewards.py"
    path.write_text(textwrap.dedent("""
        def counted(response, label, tool_calls):
            return tool_calls
        counted.worst_score = -1.0

        def keyword(response, label, *, tool_calls=0):
            return 10 * tool_calls
        keyword.worst_score = -1.0

        def plain(response, label):  # given a count it would raise, and score its worst
            return 1.0
        plain.worst_score = -1.0

        def loose(response, label, **extra):  # takes any keyword but declares no count
            return float(len(extra))
        loose.worst_score = -1.0

        def misnamed(response, tool_calls):
            return 1.0

        def three(response, label, extra):
            return 1.0

        def positional(response, label, tool_calls, /):
            return 1.0
    """))
    return path


def test_a_custom_verifier_declaring_tool_calls_gets_them_and_the_others_are_called_as_before(custom_file):
    names = [f"{custom_file}:{name}" for name in ("counted", "keyword", "plain", "loose")]
    with RewardScorer(RewardConfig(verifier_function=names, verifier_weight=[1.0] * 4)) as scorer:
        result = scorer.score(["a", "b"], ["x", "y"], tool_calls=[1, 4])
        single_turn = scorer.score(["a", "b"], ["x", "y"])
    assert list(result.scores.values()) == [[1.0, 4.0], [10.0, 40.0], [1.0, 1.0], [0.0, 0.0]]
    assert list(single_turn.scores.values()) == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
    assert not any(value for key, value in result.metrics.items() if key.endswith("/error_fraction"))


@pytest.mark.parametrize("name, call", [
    ("misnamed", r"misnamed\(response, label, tool_calls=0\)"),
    ("three", r"three\(response, label\)"),
    ("positional", r"positional\(response, label\)"),  # a count is passed by name
])
def test_a_custom_verifier_that_cannot_take_the_call_is_refused(custom_file, name, call):
    with pytest.raises(ConfigError, match=rf"cannot be called as {call}; a verifier takes the response text and "
                                          rf"the label \(two positional parameters\), optionally a parameter named "
                                          rf"tool_calls \(the sample's number of tool calls\), and returns a float"):
        RewardScorer(RewardConfig(verifier_function=[f"{custom_file}:{name}"], verifier_weight=[1.0],
                                  verifier_fail_score=[0.0]))
