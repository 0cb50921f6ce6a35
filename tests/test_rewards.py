"""Rule verifiers: a table of answer cases, the registry, weights, time limits, parallel scoring."""

import textwrap
import threading

import pytest

from mindrl.config import ConfigError
from mindrl.config.reward import RewardConfig
from mindrl.rewards import RewardScorer, get_verifier, known_verifiers
from mindrl.rewards.overlong import overlong_penalty

R1 = "<think>{t}</think>\n<answer>{a}</answer>"
PROMPT_TAIL = ("<|im_start|>user\nWhat is 2+3? Answer in \\boxed{}, e.g. <answer>\\boxed{5}</answer>.<|im_end|>\n"
               "<|im_start|>assistant\n")

# (verifier, response, label, expected score)
CASES = [
    # --- acc: last \boxed{} or <answer> tag, mathematical equality (1 / -0.5 / -1) ---
    ("acc", "so \\boxed{5}", "5", 1.0),
    ("acc", "so \\boxed{6}", "5", -0.5),
    ("acc", "the answer is 5", "5", -1.0),                                  # no boxed, no tag
    ("acc", "", "5", -1.0),                                                 # empty response
    ("acc", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),                           # \frac vs decimal
    ("acc", "\\boxed{0.5}", "1/2", 1.0),                                    # 0.5 vs 1/2
    ("acc", "\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),                 # \dfrac
    ("acc", "\\boxed{\\frac34}", "0.75", 1.0),                              # shorthand \frac34
    ("acc", "\\boxed{2/4}", "1/2", 1.0),                                    # unreduced fraction
    ("acc", "\\boxed{1,000}", "1000", 1.0),                                 # thousands separator
    ("acc", "\\boxed{1000}", "1,000", 1.0),                                 # separator in the label
    ("acc", "\\boxed{12,345.5}", "12345.5", 1.0),
    ("acc", "\\boxed{1,2}", "12", -0.5),                                    # a pair, not twelve
    ("acc", "\\boxed{-7}", "-7", 1.0),                                      # negative
    ("acc", "\\boxed{7}", "-7", -0.5),                                      # sign matters
    ("acc", "\\boxed{-\\frac{2}{3}}", "-2/3", 1.0),                         # negative fraction
    ("acc", "\\boxed{5 \\text{ cm}}", "5", 1.0),                            # unit in \text{}
    ("acc", "\\boxed{72 dollars}", "72", 1.0),                              # words around the number
    ("acc", "\\boxed{\\$18}", "18", 1.0),                                   # currency sign
    ("acc", "\\boxed{x = 4}", "4", 1.0),                                    # equation form
    ("acc", "first \\boxed{3} then corrected \\boxed{4}", "4", 1.0),        # last boxed counts
    ("acc", "first \\boxed{4} then corrected \\boxed{3}", "4", -0.5),
    ("acc", "\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),  # nested braces, symbolic
    ("acc", "\\boxed{{5}}", "5", 1.0),                                      # doubled braces
    ("acc", "\\boxed{5", "5", -1.0),                                        # unclosed brace: no answer
    ("acc", "<answer>5</answer>", "5", 1.0),                                # answer tag without boxed
    ("acc", "<answer>\\boxed{5}</answer>", "5", 1.0),
    ("acc", "<answer>5", "5", -1.0),                                        # malformed tag
    ("acc", "\\boxed{\\pi}", "3.14159", -0.5),                              # close is not equal
    ("acc", "\\boxed{0.333}", "1/3", -0.5),
    ("acc", PROMPT_TAIL + "I think it is 5.", "5", -1.0),                   # boxed only in the prompt
    ("acc", PROMPT_TAIL + "It is \\boxed{5}<|im_end|>", "5", 1.0),          # prompt dropped, end token cut
    ("acc", "\\boxed{5}<|im_end|>garbage \\boxed{6}", "5", 1.0),            # text after end of turn ignored
    ("acc", "\\boxed{5}", "#### 5", 1.0),                                   # GSM8K-style label
    # --- math_17k_acc: boxed only (1 / 0) ---
    ("math_17k_acc", "\\boxed{10}", "10", 1.0),
    ("math_17k_acc", "<answer>10</answer>", "10", 0.0),
    ("math_17k_acc", "\\boxed{11}", "10", 0.0),
    # --- gsm8k: number after ####, else last number (1 / 0) ---
    ("gsm8k", "She has 3+4 = 7 apples.\n#### 7", "7", 1.0),
    ("gsm8k", "#### $1,234", "1234", 1.0),
    ("gsm8k", "so 4 cookies, then 9 in total", "9", 1.0),                   # last number
    ("gsm8k", "so 9 in total, from 4 boxes", "9", 0.0),
    ("gsm8k", "#### 7.0", "7", 1.0),
    ("gsm8k", "no number here", "7", 0.0),
    ("gsm8k", "#### -12", "Work: 5 - 17 = -12\n#### -12", 1.0),             # label with working
    # --- format: <think>…</think> then <answer>…</answer> (1 / 0) ---
    ("format", R1.format(t="add", a="5"), "5", 1.0),
    ("format", "<think>add</think> <answer>5</answer>", "5", 1.0),
    ("format", "<answer>5</answer>", "5", 0.0),                             # no think
    ("format", "prefix <think>a</think><answer>5</answer>", "5", 0.0),      # must start with <think>
    ("format", "<think>a</think>\n<answer>5", "5", 0.0),                    # unclosed answer
    ("format", PROMPT_TAIL + R1.format(t="a", a="5") + "<|im_end|>", "5", 1.0),
    # --- strict_format (1 / -0.5) ---
    ("strict_format", R1.format(t="a", a="\\boxed{5}"), "5", 1.0),
    ("strict_format", R1.format(t="a", a="5"), "5", -0.5),                  # no boxed
    ("strict_format", R1.format(t="a", a="\\boxed{5} \\boxed{6}"), "5", -0.5),
    ("strict_format", R1.format(t="<think>a", a="\\boxed{5}"), "5", -0.5),  # two <think>
    ("strict_format", R1.format(t="a", a="\\boxed{5}") + " ", "5", -0.5),   # trailing text
    ("strict_format", "<answer>\\boxed{5}</answer><think>a</think>", "5", -0.5),
    # --- base_acc: R1 layout and right boxed answer (1 / 0) ---
    ("base_acc", R1.format(t="a", a="\\boxed{5}"), "5", 1.0),
    ("base_acc", R1.format(t="a", a="\\boxed{6}"), "5", 0.0),
    ("base_acc", "\\boxed{5}", "5", 0.0),                                   # right answer, wrong layout
]


@pytest.mark.parametrize("verifier, response, label, expected", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_answer_table(verifier, response, label, expected):
    assert get_verifier(verifier)(response, label) == expected


def test_the_table_is_large_and_covers_every_builtin():
    assert len(CASES) >= 40
    assert {c[0] for c in CASES} == set(known_verifiers())


def test_unknown_verifier_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown verifier 'acuracy' .*known: acc, base_acc, format"):
        RewardScorer(RewardConfig(verifier_function=["acuracy"], verifier_weight=[1.0]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(verifier_function=["acc", "format"], verifier_weight=[1.0]), "has 2 entries but verifier_weight has 1"),
    (dict(verifier_function=[], verifier_weight=[]), "verifier_function is empty"),
    (dict(verifier_parallel=0), "verifier_parallel must be an integer >= 1"),
    (dict(verifier_timeout=0), "verifier_timeout must be a positive"),
    (dict(overlong_buffer_enable=True, overlong_buffer=4096, rollout_max_tokens=2048), "must be between 0 and"),
])
def test_config_mistakes_are_one_sentence(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RewardConfig(**kwargs)


def test_weighted_total_and_per_verifier_metrics():
    scorer = RewardScorer(RewardConfig(verifier_function=["acc", "format"], verifier_weight=[1.0, 0.5]))
    result = scorer.score([R1.format(t="a", a="\\boxed{5}"), "\\boxed{4}", "nothing"], ["5", "5", "5"])
    assert result.rewards == [1.5, -0.5, -1.0]
    assert result.scores == {"acc": [1.0, -0.5, -1.0], "format": [1.0, 0.0, 0.0]}
    assert result.metrics["acc_rewards/mean"] == pytest.approx(-0.5 / 3)
    assert result.metrics["format_rewards/mean"] == pytest.approx(1 / 3)
    assert result.metrics["acc/timeout_fraction"] == 0 and result.metrics["format/error_fraction"] == 0


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent("""
        import time

        def length_bonus(response, label):
            return min(len(response), 10) / 10

        def slow(response, label):
            if "slow" in response:
                time.sleep(30)
            return 1.0

        def broken(response, label):
            if "boom" in response:
                raise RuntimeError("boom")
            return 1.0
    """))
    return path


def test_custom_verifier_from_a_file_path(custom_file):
    scorer = RewardScorer(RewardConfig(verifier_function=[f"{custom_file}:length_bonus"], verifier_weight=[2.0]))
    assert scorer.score(["abcde", "x" * 50], ["", ""]).rewards == [1.0, 2.0]


def test_custom_verifier_from_a_module_path():
    scorer = RewardScorer(RewardConfig(verifier_function=["mindrl.rewards.verifiers:accuracy"],
                                       verifier_weight=[1.0]))
    assert scorer.score(["\\boxed{3}"], ["3"]).rewards == [1.0]
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        RewardScorer(RewardConfig(verifier_function=["mindrl.rewards.verifiers:nope"], verifier_weight=[1.0]))


@pytest.mark.parametrize("parallel", [1, 2])
def test_timeouts_and_errors_score_zero_are_counted_and_the_batch_goes_on(custom_file, parallel):
    config = RewardConfig(verifier_function=[f"{custom_file}:slow", f"{custom_file}:broken"],
                          verifier_weight=[1.0, 1.0], verifier_timeout=0.5, verifier_parallel=parallel)
    with RewardScorer(config) as scorer:
        result = scorer.score(["fine", "slow one", "boom", "fine"], ["", "", "", ""])
    assert result.rewards == [2.0, 1.0, 1.0, 2.0]
    assert result.metrics[f"{custom_file}:slow/timeout_fraction"] == 0.25
    assert result.metrics[f"{custom_file}:broken/error_fraction"] == 0.25


def test_time_limit_holds_outside_the_main_thread(custom_file):
    config = RewardConfig(verifier_function=[f"{custom_file}:slow"], verifier_weight=[1.0], verifier_timeout=0.5)
    out = {}

    def run():
        with RewardScorer(config) as scorer:
            out["result"] = scorer.score(["slow", "ok"], ["", ""])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    assert out["result"].rewards == [0.0, 1.0]


def test_parallel_scoring_equals_serial():
    responses = [c[1] for c in CASES if c[0] == "acc"] * 3
    labels = [c[2] for c in CASES if c[0] == "acc"] * 3
    serial = RewardScorer(RewardConfig(verifier_function=["acc", "format"], verifier_weight=[1.0, 0.1]))
    with RewardScorer(RewardConfig(verifier_function=["acc", "format"], verifier_weight=[1.0, 0.1],
                                   verifier_parallel=2)) as parallel:
        assert parallel.score(responses, labels).rewards == serial.score(responses, labels).rewards


@pytest.mark.parametrize("length, expected", [(0, 0.0), (1536, 0.0), (1792, -0.5), (2048, -1.0), (4000, -1.0)])
def test_overlong_penalty(length, expected):
    assert overlong_penalty(length, max_tokens=2048, buffer=512, factor=1.0) == pytest.approx(expected)


def test_overlong_penalty_is_added_and_reported():
    config = RewardConfig(verifier_function=["acc"], verifier_weight=[1.0], overlong_buffer_enable=True,
                          overlong_buffer=100, overlong_buffer_penalty_factor=0.5, rollout_max_tokens=300)
    result = RewardScorer(config).score(["\\boxed{1}", "\\boxed{1}"], ["1", "1"], response_lengths=[150, 250])
    assert result.rewards == [1.0, 0.75]
    assert result.metrics["overlong/fraction"] == 0.5
    with pytest.raises(ValueError, match="needs the token length"):
        RewardScorer(config).score(["x"], ["1"])
