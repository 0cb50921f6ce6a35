"""MindSpeed-RL's acc_for_dapo, math_verify_reward, acc_for_ppo and step: hand-worked tables with the traps of
each documented behaviour, math_verify_reward against math-verify's own math_metric, step against its regex."""

import random
import re

import pytest
from math_verify import ExprExtractionConfig, LatexExtractionConfig, math_metric

from mindrl.rewards import get_verifier
from mindrl.rewards.answers import response_only
from mindrl.rewards.verifiers import r1_layout

R1 = "<think>{t}</think>\n<answer>{a}</answer>"
PROMPT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def r1_boxed(answer: str, thinking: str = "let me think") -> str:
    return R1.format(t=thinking, a="\\boxed{" + answer + "}")


# (response, label, expected score)
DAPO = [
    ("Answer: 5", "5", 1.0),
    ("Answer: 6", "5", -1.0),
    ("answer: 5", "5", 1.0),                                           # any case
    ("ANSWER : 5", "5", 1.0),                                          # spaces around the colon
    ("So the final answer: 5", "5", 1.0),                              # `answer:` inside a phrase
    ("Answer: 3\nAnswer: 5", "5", 1.0),                                # the last Answer line wins
    ("Answer: 5\nAnswer: 3", "5", -1.0),
    ("Answer: 5\n" + "x" * 290, "5", 1.0),                             # 300 characters: all read
    ("Answer: 5\n" + "x" * 291, "5", -1.0),                            # the `A` falls outside the last 300
    ("The answer is \\boxed{5}", "5", -1.0),                           # a box without an Answer line
    ("Answer: 5 cm", "5", 1.0),                                        # unit words go
    ("Answer: 10 dollars", "10", 1.0),
    ("Answer: 90^\\circ", "90", 1.0),
    ("Answer: 5 \\text{ cm}", "5", 1.0),                               # `cm` goes, then the empty \text{}
    ("Answer: \\text{5}", "5", 1.0),
    ("Answer: \\boxed{5}", "5", 1.0),
    ("Answer: $5$", "5", 1.0),
    ("Answer: The answer is $\\frac{1}{2}$", "\\frac{1}{2}", 1.0),     # only the `$…$` is kept
    ("Answer: x = 5", "5", 1.0),                                       # text after the last `=`
    ("Answer: 5", "x = 5", 1.0),                                       # the label's too
    ("Answer: 1,000", "1000", 1.0),                                    # commas of a number that is all digits
    ("Answer: 1000", "1,000", 1.0),
    ("Answer: 1,000.5", "1000.5", -1.0),                               # not all digits: the comma stays
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0),                         # TeX's one-character arguments braced
    ("Answer: 0.5", "\\frac{1}{2}", -1.0),                             # a string match, not a value
    ("Answer: 5.", "5", -1.0),                                         # a trailing period stays
    ("Answer: $5.$", "5", 1.0),                                        # … except before a `$`
    ("Answer: 5\n more text", "5", 1.0),                               # to the end of the line only
    ("Answer:\n5", "5", 1.0),                                          # `\s*` crosses the line end
    ("Answer: an apple", "apple", 1.0),                                # `an ` and `a ` go
    ("Answer: a banana", "banana", 1.0),
    ("Answer: a banana split", "bananasplit", -1.0),                   # `banana ` loses its last `a`
    ("Answer: a banana split", "banana split", 1.0),                   # … on both sides alike
    ("Answer: 4 \\text{ and } 5", "45", 1.0),                          # `\text{and}` is a comma, then dropped
    ("no answer line at all", "[INVALID]", 1.0),                       # the placeholder is compared too
    (PROMPT.format(q="Answer: 5") + "I think 6.\nAnswer: 6<|im_end|>", "5", -1.0),  # the prompt's line is not read
    (PROMPT.format(q="Reply as Answer: N") + "Answer: 5<|im_end|>", "5", 1.0),
]

MATH_VERIFY = [
    # the layout (base_acc's) fails: 0 whatever the answer
    ("\\boxed{5}", "5", 0.0),                                          # no tags
    ("<answer>\\boxed{5}</answer>", "5", 0.0),                         # no <think>
    ("<think>a</think><answer>\\boxed{5}</answer> extra", "5", 0.0),   # text after </answer>
    ("<think>a</think><answer>5</answer>", "5", 0.0),                  # no \boxed
    ("<think>a</think>\\boxed{5}", "5", 0.0),                          # no <answer>
    # the layout holds: math-verify decides
    (r1_boxed("5"), "5", 1.0),
    (r1_boxed("6"), "5", 0.0),
    (r1_boxed("-5"), "5", 0.0),
    (r1_boxed("5.0"), "5", 1.0),
    (r1_boxed("\\frac{1}{2}"), "0.5", 1.0),
    (r1_boxed("0.5"), "\\frac{1}{2}", 1.0),
    (r1_boxed("2/4"), "\\frac{1}{2}", 1.0),
    (r1_boxed("\\frac12"), "\\frac{1}{2}", 1.0),
    (r1_boxed("0.75"), "\\dfrac{3}{4}", 1.0),                          # LaTeX in the label
    (r1_boxed("1/3"), "0.333333", 1.0),                                # equal to 6 decimal places
    (r1_boxed("0.333"), "\\frac{1}{3}", 0.0),
    (r1_boxed("\\{1, 2\\}"), "\\{2, 1\\}", 1.0),                       # sets, in any order
    (r1_boxed("\\{1,2,3\\}"), "\\{1,2\\}", 0.0),
    (r1_boxed("[1, 3)"), "[1,3)", 1.0),                                # intervals
    (r1_boxed("(1, 3)"), "[1, 3]", 0.0),
    (r1_boxed("\\sqrt{8}"), "2\\sqrt{2}", 1.0),
    (r1_boxed("2"), "\\sqrt{4}", 1.0),
    (r1_boxed("\\frac{\\sqrt{2}}{2}"), "\\frac{1}{\\sqrt{2}}", 1.0),
    (r1_boxed("\\pi"), "\\pi", 1.0),
    (r1_boxed("3.14"), "\\pi", 0.0),
    (r1_boxed("(x+1)^2"), "x^2 + 2x + 1", 1.0),                        # symbolic equality
    (r1_boxed("x = 5"), "5", 1.0),
    (r1_boxed("1,000"), "1000", 1.0),
    (r1_boxed("10\\%"), "10", 0.0),
    (r1_boxed("5 \\text{ cm}"), "5", 1.0),
    (r1_boxed("\\text{yes}"), "\\text{yes}", 1.0),
    (r1_boxed("5", thinking="maybe \\boxed{3}"), "5", 1.0),            # the last box is the answer
    (r1_boxed("3", thinking="maybe \\boxed{5}"), "5", 0.0),
    (R1.format(t="x", a="The answer is \\boxed{12} dollars."), "12", 1.0),
    (r1_boxed("5"), "", 0.0),                                          # a label math-verify cannot read
    (r1_boxed("5") + "\n", "5", 0.0),                                  # fullmatch: nothing after </answer>
    (PROMPT.format(q="Put it in \\boxed{}.") + r1_boxed("5") + "<|im_end|>", "5", 1.0),
]

PPO = [
    ("\\boxed{5}", "5", 1.0),
    ("\\boxed{6}", "5", 0.0),
    ("the answer is 5", "5", 0.0),                                     # no box
    ("", "5", 0.0),
    ("Answer: 5", "5", 0.0),                                           # DAPO's line is no box
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),                             # mathematical equality
    ("\\boxed{2/4}", "1/2", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{-7}", "7", 0.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{72 dollars}", "72", 1.0),
    ("\\boxed{x = 4}", "4", 1.0),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{\\text{yes}}", "yes", 1.0),
    ("\\boxed{(B)}", "B", 1.0),
    ("\\boxed{5} and then \\boxed{6}", "5", 0.0),                      # the last box
    ("\\boxed{5", "5", 0.0),                                           # unclosed
    ("\\boxed{}", "5", 0.0),                                           # empty
    ("\\boxed 5", "5", 1.0),                                           # as TeX reads it
    ("<think>\\boxed{3}</think> so \\boxed{4}", "4", 1.0),             # after the thinking first
    ("<think>\\boxed{4}</think> so \\boxed{3}", "4", 0.0),
    ("<think>only \\boxed{4}</think> done", "4", 1.0),                 # the thinking when nothing follows
    (PROMPT.format(q="e.g. \\boxed{5}") + "so \\boxed{5}<|im_end|>", "5", 1.0),
    (PROMPT.format(q="e.g. \\boxed{5}") + "no idea<|im_end|>", "5", 0.0),  # the prompt's box is not the answer
]

STEP = [
    ("", 0.0),
    ("Step 1: add", 1 / 3),
    ("Step 1: add. Step 2: carry.", 2 / 3),
    ("Step 1: a Step 2: b Step 3: c", 1.0),
    ("Step 1: a Step 2: b Step 3: c Step 4: d", 1.0),                  # capped at 1
    ("Step 12: a", 1 / 3),
    ("Step 1:Step 2:", 2 / 3),
    ("Step one: a", 0.0),
    ("step 1: a", 0.0),                                                # case matters
    ("Step 1 : a", 0.0),
    ("1. add", 1 / 3),                                                 # a number at the very start
    ("12. add", 1 / 3),
    ("1.5 is it", 1 / 3),                                              # … a decimal too
    ("x\n1. add\n2. carry", 0.0),                                      # no other line: not multi-line
    ("1. a\n2. b\n3. c", 1 / 3),
    ("\n- a\n- b", 2 / 3),
    ("- a\n- b", 1 / 3),                                               # a bullet needs a newline before it
    ("\n* a\n* b\n* c", 1.0),
    ("First, a. Second, b. Finally, c.", 1.0),
    ("Next, x", 1 / 3),
    ("First a, second b", 0.0),                                        # the word must take the comma
    ("first, a", 0.0),
    ("Firstly, a", 0.0),
    ("Step 1:\n- a\nFirst, b\n* c", 1.0),
    (PROMPT.format(q="Step 1: Step 2: Step 3:") + "1. go<|im_end|>", 1 / 3),  # the response alone, from its start
]

TABLES = {
    "acc_for_dapo": DAPO,
    "math_verify_reward": MATH_VERIFY,
    "acc_for_ppo": PPO,
    "step": [(response, "", expected) for response, expected in STEP],
}
# (verifier, response, label, expected score)
CASES = [(name, *case) for name, table in TABLES.items() for case in table]


@pytest.mark.parametrize("verifier, response, label, expected", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_answer_table(verifier, response, label, expected):
    assert get_verifier(verifier)(response, label) == expected


@pytest.mark.parametrize("name", sorted(TABLES))
def test_each_table_has_twenty_cases(name):
    assert len(TABLES[name]) >= 20


def test_worst_scores():
    worst = {name: get_verifier(name).worst_score for name in TABLES}
    assert worst == {"acc_for_dapo": -1.0, "math_verify_reward": 0.0, "acc_for_ppo": 0.0, "step": 0.0}


def test_acc_for_ppo_is_math_17k_acc():
    assert get_verifier("acc_for_ppo") is get_verifier("math_17k_acc")
    assert all(get_verifier("math_17k_acc")(response, label) == expected for response, label, expected in PPO)


def _mindspeed_math_verify(response: str, label: str) -> float:
    """MindSpeed-RL's compute_math_score: math_metric as it configures it, any error scored 0."""
    metric = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                         pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
    try:
        return metric(["\\boxed{" + label + "}"], [response])[0]
    except Exception:
        return 0.0


@pytest.mark.parametrize("response, label, expected", [case for case in MATH_VERIFY
                                                       if r1_layout(response_only(case[0]))])
def test_math_verify_reward_agrees_with_math_metric(response, label, expected):
    assert get_verifier("math_verify_reward")(response, label) == _mindspeed_math_verify(response_only(response), label)


STEP_REGEX = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")
STEP_PIECES = ["Step ", "step ", "1", "23", ":", ".", "\n", "-", "*", "First,", "Second,", "Next,", "Finally,",
               "First", "Next", ",", " ", "x"]


def test_step_counts_as_the_regex_does():
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice(STEP_PIECES) for _ in range(rng.randrange(16)))
        assert get_verifier("step")(text, "") == min(1.0, len(STEP_REGEX.findall(text)) / 3), text
