"""Rule verifiers: a table of answer cases, the registry, weights, worst scores, time limits that
hold, crashing workers, linear-time layout checks, parallel scoring."""

import itertools
import os
import random
import re
import signal
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
from math_verify import parse, verify

from mindrl.config import ConfigError
from mindrl.config.reward import RewardConfig
from mindrl.data.templates import load_templates
from mindrl.rewards import RewardScorer, VerifierCrash, get_verifier, known_verifiers
from mindrl.rewards.answers import ASSISTANT_HEADERS, response_only
from mindrl.rewards.equality import _reference, answers_equal
from mindrl.rewards.overlong import overlong_penalty
from mindrl.rewards.verifiers import count_boxed, loose_layout, r1_layout
from tests.test_mindspeed_verifiers import CASES as MINDSPEED_CASES

R1 = "<think>{t}</think>\n<answer>{a}</answer>"
PROMPT_TAIL = ("<|im_start|>user\nWhat is 2+3? Answer in \\boxed{}, e.g. <answer>\\boxed{5}</answer>.<|im_end|>\n"
               "<|im_start|>assistant\n")
COLUMN_123 = "\\begin{pmatrix} 1 \\\\ 2 \\\\ 3 \\end{pmatrix}"
LLAMA3_TAIL = ("<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+3?<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n")

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
    # --- a number inside other maths is not that number (1: the single-number fallback) ---
    ("acc", "\\boxed{\\sqrt{3}}", "3", -0.5),
    ("acc", "\\boxed{2\\pi}", "2", -0.5),
    ("acc", "\\boxed{(-\\infty, 3)}", "3", -0.5),                          # an interval
    ("acc", "\\boxed{[1, 3]}", "3", -0.5),
    ("acc", "\\boxed{2x}", "2", -0.5),                                      # a variable attached
    ("acc", "\\boxed{2 x}", "2", -0.5),
    ("acc", "\\boxed{3i}", "3", -0.5),
    ("acc", "\\boxed{\\frac{3}{2}}", "3", -0.5),
    ("acc", "\\boxed{2^{10}}", "2", -0.5),
    ("acc", "\\boxed{3!}", "3", -0.5),
    ("acc", "\\boxed{negative 3}", "3", -0.5),                              # words that change the value
    ("acc", "\\boxed{3 million}", "3", -0.5),
    ("acc", "\\boxed{about 12}", "12", -0.5),
    ("acc", "\\boxed{12 apples and 3 pears}", "12", -0.5),                  # another number
    ("acc", "\\boxed{12.0 dollars}", "12", 1.0),                            # near misses that stay right
    ("acc", "<answer>so it is 12</answer>", "12", 1.0),
    ("acc", "\\boxed{\\$ 18}", "18", 1.0),
    ("acc", "\\boxed{3 m}", "3", 1.0),
    ("acc", "\\boxed{2^{10}}", "1024", 1.0),
    ("acc", "\\boxed{007}", "7", 1.0),
    ("acc", "\\boxed{5.}", "5", 1.0),
    # --- unicode look-alikes mean their ASCII / LaTeX ---
    ("acc", "\\boxed{−3}", "3", -0.5),                                      # U+2212 minus
    ("acc", "\\boxed{−3}", "-3", 1.0),
    ("acc", "\\boxed{–3}", "-3", 1.0),                                      # en dash
    ("acc", "\\boxed{−\\frac{1}{2}}", "-0.5", 1.0),
    ("acc", "\\boxed{３}", "3", 1.0),                                        # fullwidth digit
    ("acc", "\\boxed{x²}", "x^2", 1.0),
    ("acc", "\\boxed{10⁻³}", "0.001", 1.0),
    ("acc", "\\boxed{½}", "0.5", 1.0),
    ("acc", "\\boxed{√3}", "\\sqrt{3}", 1.0),
    ("acc", "\\boxed{2·3}", "6", 1.0),
    ("acc", "\\boxed{∞}", "\\infty", 1.0),
    # --- text answers compare by their content (2: \text{} was deleted with its content) ---
    ("acc", "\\boxed{\\text{yes}}", "\\text{no}", -0.5),
    ("acc", "\\boxed{\\text{(A)}}", "\\text{(C)}", -0.5),
    ("acc", "\\boxed{\\text{odd}}", "\\text{even}", -0.5),
    ("acc", "\\boxed{\\text{red car}}", "\\text{car red}", -0.5),
    ("acc", "\\boxed{yes}", "\\text{sey}", -0.5),                           # not a product of symbols
    ("acc", "\\boxed{\\text{(B)}}", "(B)", 1.0),
    ("acc", "\\boxed{B}", "(B)", 1.0),
    ("acc", "\\boxed{\\textbf{(B)}}", "B", 1.0),
    ("acc", "\\boxed{(B)}", "\\text{(C)}", -0.5),
    ("acc", "\\boxed{\\text{yes}}", "yes", 1.0),
    ("acc", "\\boxed{\\text{Yes}}", "\\text{yes}", 1.0),
    ("acc", "\\boxed{\\text{North}}", "north", 1.0),
    ("acc", "\\boxed{5\\ \\text{cm}}", "5", 1.0),
    # --- matrix rows survive spacing (3: `\\ ` was read as a thin space) ---
    ("acc", f"\\boxed{{{COLUMN_123}}}", "\\begin{pmatrix} 1 \\\\ 5 \\\\ 7 \\end{pmatrix}", -0.5),
    ("acc", f"\\boxed{{{COLUMN_123}}}", "\\begin{pmatrix} 1 \\\\ 2 \\\\ 4 \\end{pmatrix}", -0.5),
    ("acc", "\\boxed{\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}}", "\\begin{bmatrix}1&2\\\\3&5\\end{bmatrix}",
     -0.5),
    ("acc", "\\boxed{\\begin{pmatrix}1\\\\2\\\\3\\end{pmatrix}}", COLUMN_123, 1.0),
    ("acc", "\\boxed{\\begin{pmatrix} 1\\ \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 1.0),
    ("acc", "\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    # --- the whole template header goes, not part of it (4) ---
    ("format", LLAMA3_TAIL + R1.format(t="a", a="\\boxed{5}") + "<|eot_id|>", "5", 1.0),
    ("base_acc", LLAMA3_TAIL + R1.format(t="a", a="\\boxed{5}") + "<|eot_id|>", "5", 1.0),
    ("strict_format", LLAMA3_TAIL + R1.format(t="a", a="\\boxed{5}") + "<|eot_id|>", "5", 1.0),
    ("format", PROMPT_TAIL + "\n" + R1.format(t="a", a="5"), "5", 0.0),    # the policy's own newline stays
    ("base_acc", "<｜User｜>Q<｜Assistant｜>" + R1.format(t="a", a="\\boxed{5}"), "5", 1.0),
    ("gsm8k", "so 9 in total from 1,234,567 grains", "1234567", 1.0),
    ("gsm8k", "#### −12", "-12", 1.0),
    ("gsm8k", "#### −12", "12", 0.0),
    ("gsm8k", "it drops to −3 degrees", "-3", 1.0),
    ("gsm8k", "The answer is 28.", "28", 1.0),                              # the learning demo's layout
    ("answer_sentence", "The answer is 28.", "28", 1.0),                    # layout only, right or wrong
    ("answer_sentence", "The answer is -3.", "7", 1.0),
    ("answer_sentence", PROMPT_TAIL + "The answer is 5.<|im_end|>", "5", 1.0),
    ("answer_sentence", "The answer is 28", "28", 0.0),
    ("answer_sentence", "I think the answer is 28.", "28", 0.0),
    ("answer_sentence", "The answer is 28. The answer is 29.", "28", 0.0),
    ("answer_sentence", "The answer is twenty.", "20", 0.0),
    # --- a comma inside a pair, interval or set separates items, not thousands ---
    ("acc", "\\boxed{(2,500)}", "(2, 500)", 1.0),
    ("acc", "\\boxed{2500}", "(2,500)", -0.5),
    ("acc", "\\boxed{(2,500)}", "2500", -0.5),
    ("acc", "\\boxed{[0, 100]}", "[0,100]", 1.0),
    ("acc", "\\boxed{\\{100,0\\}}", "\\{0,100\\}", 1.0),
    ("acc", "\\boxed{1\\,000}", "1000", 1.0),                                # thin-space separators
    ("acc", "\\boxed{1 000 000}", "10^6", 1.0),
    # --- words that scale, divide or negate a number, and units that differ ---
    ("acc", "\\boxed{1 fifth}", "1", -0.5),
    ("acc", "\\boxed{5 tens}", "5", -0.5),
    ("acc", "\\boxed{twice 5}", "5", -0.5),
    ("acc", "\\boxed{reciprocal of 5}", "5", -0.5),
    ("acc", "\\boxed{cannot be 5}", "5", -0.5),
    ("acc", "\\boxed{5 trillion}", "5", -0.5),
    ("acc", "\\boxed{5 minutes}", "5 seconds", -0.5),
    ("acc", "\\boxed{5 cm}", "5 m", -0.5),
    ("acc", "\\boxed{\\$18}", "18 cents", -0.5),
    ("acc", "\\boxed{5\\text{ inches}}", "5 inch", 1.0),
    ("acc", "\\boxed{12 \\text{ square feet}}", "12", 1.0),
    ("acc", "\\boxed{50 percent}", "50", 1.0),
    ("acc", "\\boxed{exactly 5}", "5", 1.0),
    ("acc", "\\boxed{\\text{5 cm}}", "5", 1.0),
    ("acc", "\\boxed{\\text{\\$}18}", "18", 1.0),
    # --- word answers keep their meaning through punctuation and styling; choices by their letter ---
    ("acc", "\\boxed{\\text{Yes.}}", "\\text{yes}", 1.0),
    ("acc", "\\boxed{\\textbf{\\text{yes}}}", "\\text{yes}", 1.0),
    ("acc", "\\boxed{\\text{(yes)}}", "\\text{yes}", 1.0),
    ("acc", "\\boxed{\\text{Option B}}", "B", 1.0),
    ("acc", "\\boxed{\\text{(B) } 12}", "(B)", 1.0),
    ("acc", "\\boxed{\\text{Option C}}", "B", -0.5),
    # --- the last box with an argument ---
    ("acc", "\\boxed 5", "5", 1.0),
    ("acc", "\\boxed5", "5", 1.0),
    ("acc", "\\boxed{5}. Remember to put the answer in \\boxed.", "5", 1.0),
    ("acc", "\\boxed{5} (I used \\boxed as asked)", "5", 1.0),
    ("acc", "\\boxed{}", "5", -1.0),                                         # an empty box is no answer
    ("acc", "<answer>\\boxed{ }</answer>", "5", -1.0),
    # --- digits of other scripts, fractions after ####, repeating decimals, doubled groups ---
    ("acc", "\\boxed{٥}", "5", 1.0),
    ("acc", "\\boxed{५}", "6", -0.5),
    ("acc", "\\boxed{➖ 5}", "-5", 1.0),
    ("gsm8k", "#### ٥", "5", 1.0),
    ("gsm8k", "#### 1/2", "0.5", 1.0),
    ("acc", "\\boxed{0.\\overline{3}}", "\\frac{1}{3}", 1.0),
    ("acc", "\\boxed{-0.1\\overline{6}}", "-1/6", 1.0),
    ("acc", "\\boxed{0.\\overline{3}}", "0.3", -0.5),
    ("acc", "\\boxed{" + "{" * 16 + "5" + "}" * 16 + "}", "5", 1.0),         # math-verify took > 10 s
    ("acc", "\\boxed{" + "(" * 60 + "5" + ")" * 60 + "}", "5", 1.0),
    ("acc", "\\boxed{⅕}", "0.2", 1.0),
    # --- a list is not one number; a choice is one letter ---
    ("acc", "\\boxed{5, 125}", "125, 5", 1.0),
    ("acc", "\\boxed{10200}", "10, 200", -0.5),
    ("acc", "\\boxed{x=-2 \\text{ or } x=100}", "-2, 100", 1.0),
    ("acc", "\\boxed{(A) or (B)}", "(A)", -0.5),
    ("acc", "\\boxed{\\text{(B) and (D)}}", "B", -0.5),
    # --- a number's words worked in: counts, signs, scales, unit names ---
    ("acc", "\\boxed{7 times}", "7", 1.0),
    ("acc", "\\boxed{4 more}", "4", 1.0),
    ("acc", "\\boxed{negative 7}", "-7", 1.0),
    ("acc", "\\boxed{3 million}", "3000000", 1.0),
    ("acc", "\\boxed{9 twentieths}", "9", -0.5),
    ("acc", "\\boxed{2 fifteenths}", "2", -0.5),
    ("acc", "\\boxed{5 \\text{ feet}}", "5\\text{ ft}", 1.0),
    ("acc", "\\boxed{6 \\text{ hrs}}", "6 \\text{ hours}", 1.0),
    ("acc", "\\boxed{12 apples}", "13", -0.5),
    ("acc", "\\boxed{20 \\text{ sq ft}}", "20 \\text{ square feet}", 1.0),
    ("acc", "\\boxed{The answer is B}", "B", 1.0),
    # --- the final answer comes after the thinking ---
    ("acc", PROMPT_TAIL + "<think>\nMaybe \\boxed{5}? No wait\n</think>\n<answer>7</answer><|im_end|>", "5", -0.5),
    ("acc", PROMPT_TAIL + "<think>\nMaybe \\boxed{5}? No wait\n</think>\n<answer>7</answer><|im_end|>", "7", 1.0),
    ("acc", "<think>so it is \\boxed{5}</think>", "5", 1.0),                 # answered only while thinking
    ("math_17k_acc", "<think>\\boxed{4}</think> so \\boxed{5}", "5", 1.0),
    ("gsm8k", "<think>\nfirst guess #### 70, hmm no\n</think>\nThe answer is 72.", "72", 1.0),
    ("gsm8k", "The total is 1,234, which is the answer.", "1234", 1.0),
    ("gsm8k", "#### \\$1{,}234", "1234", 1.0),
    # --- verl's / EasyR1's Geometry3K rewards: the last box anywhere; think first, a box after it ---
    ("geo3k_acc", "<think>\\boxed{4}</think> so \\boxed{30}", "30", 1.0),
    ("geo3k_acc", "<think>so \\boxed{30}</think>", "30", 1.0),                 # answered while thinking counts
    ("geo3k_acc", "\\boxed{30} then \\boxed{4}", "30", 0.0),
    ("geo3k_acc", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("geo3k_acc", "30", "30", 0.0),                                           # no box, no credit
    ("geo3k_format", "<think>a</think>\\boxed{1}", "1", 1.0),
    ("geo3k_format", "<think>a</think> so it is \\boxed{}. Done", "1", 1.0),  # right or wrong, even empty
    ("geo3k_format", PROMPT_TAIL + "<think>a</think>\\boxed{1}<|im_end|>", "1", 1.0),
    ("geo3k_format", " <think>a</think>\\boxed{1}", "1", 0.0),
    ("geo3k_format", "<think>\\boxed{1}</think>", "1", 0.0),                   # the box must follow the thinking
    ("geo3k_format", "<think>a</think>\\boxed{1", "1", 0.0),
    # --- the tool-call verifiers, called as a single-turn run calls them (0 calls; tests/test_rewards_tool_calls.py
    # gives them counts) ---
    ("tool_call_bonus", "\\boxed{5}", "5", 0.0),
    ("tool_use_bonus", "\\boxed{5}", "5", 0.0),
    ("retool_reward", PROMPT_TAIL + "so it is \\boxed{5}<|im_end|>", "5", 1.0),
    ("retool_reward", PROMPT_TAIL + "no idea<|im_end|>", "5", -1.0),        # the prompt's box is not the answer
    ("retool_reward", "\\boxed{5.0}", "5", -1.0),                            # the label's string, not its value
    ("retool_reward", "\\boxed{5}" + " and so on" * 10, "5", -1.0),         # before the last 100 characters
]


@pytest.mark.parametrize("verifier, response, label, expected", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_answer_table(verifier, response, label, expected):
    assert get_verifier(verifier)(response, label) == expected


def test_the_table_is_large_and_covers_every_builtin():
    """This table and the MindSpeed-RL ports' tables (tests/test_mindspeed_verifiers.py) together."""
    assert len(CASES) >= 100
    assert {c[0] for c in CASES} | {c[0] for c in MINDSPEED_CASES} == set(known_verifiers())


def _math_verify(predicted: str, reference: str) -> bool:
    gold, pred = parse(f"${reference}$", parsing_timeout=None), parse(f"${predicted}$", parsing_timeout=None)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


NUMBERS = ["0", "7", "-7", "−7", "12", "1000", "1,000", "12,345", "12345", "0.5", ".5", "-0.25", "2.50", "2.5",
           "\\frac{1}{2}", "\\frac{5}{2}", "3/4", "\\dfrac{6}{8}", "-\\frac{2}{3}", "007", "1/3", "0.333333"]


def test_the_fast_paths_agree_with_math_verify_on_numbers():
    """Exact match, integer and rational shortcuts never change math-verify's verdict."""
    disagree = [(p, g) for p, g in itertools.product(NUMBERS, NUMBERS) if answers_equal(p, g) != _math_verify(p, g)]
    assert not disagree


@pytest.mark.parametrize("predicted, reference", [
    ("\\sqrt{3}", "3"), ("2\\pi", "2"), ("(-\\infty, 3)", "3"), ("−3", "3"), ("\\text{yes}", "\\text{no}"),
    ("\\text{(A)}", "\\text{(C)}"), ("\\text{(B)}", "(B)"), ("\\textbf{(B)}", "B"), ("x = 4", "4"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\\\ 3 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 5 \\\\ 7 \\end{pmatrix}"),
    ("\\begin{pmatrix}1\\\\2\\\\3\\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\\\ 3 \\end{pmatrix}"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"), ("5 \\text{ cm}", "5"), ("\\$18", "18"),
])
def test_agrees_with_math_verify_where_it_is_right(predicted, reference):
    assert answers_equal(predicted, reference) == _math_verify(predicted, reference)


def test_each_label_is_worked_out_once_per_group():
    label = "Work: 6 * 7 = 42\n#### 42"
    before = _reference.cache_info().misses
    verdicts = [answers_equal(answer, label) for answer in ("42", "41", "\\frac{84}{2}", "42 apples", "x")]
    assert verdicts == [True, False, True, True, False]
    assert _reference.cache_info().misses - before == 1


@pytest.mark.parametrize("name", sorted(load_templates()))
def test_every_template_leaves_exactly_the_response(name):
    """A decoded sequence is prompt + response + stop word, for each template in configs/model/templates.json."""
    template = load_templates()[name]
    prompt = template.render("What is 2+3? Reply <answer>\\boxed{9}</answer>.",
                             tokenizer=SimpleNamespace(bos_token="<s>"))
    if prompt.endswith("<answer>\\boxed{9}</answer>."):
        pytest.skip(f"{name} has no assistant turn header: the scorer must be given the response alone")
    assert any(prompt.endswith(header + suffix) for header, suffix in ASSISTANT_HEADERS), \
        f"add the assistant header of template {name!r} to ASSISTANT_HEADERS"
    response = R1.format(t="2 plus 3", a="\\boxed{5}")
    decoded = prompt + response + (template.stop_words[0] if template.stop_words else "")
    assert response_only(decoded) == response
    for verifier in ("acc", "base_acc", "format", "strict_format"):
        assert get_verifier(verifier)(decoded, "5") == 1.0, verifier


# --- every verifier is linear-time on truncated repetition loops -----------------------------------------------

def _loop(unit: str, head: str = "", length: int = 10_000) -> str:
    return (head + unit * (length // len(unit) + 1))[:length]


LOOPS = {
    "all tags": _loop("Wait, </think> maybe <answer> \\boxed{3} is 1,234, wrong. ", head="<think>"),
    "think then answer": _loop("a</think> <answer> b ", head="<think>"),
    "think then answer, newlines": _loop("</think>\n\n\n<answer>\n", head="<think>"),
    "closed tags mid-line": _loop("<think></think><answer></answer>x", head="<think>"),
    "open answer tags": _loop("<answer> x "),
    "open boxes after a closed answer": _loop("\\boxed{ ", head="<think>a</think><answer>x</answer>"),
    "thousands chain": _loop("1,111,"),
    "digits": _loop("1"),
    "empty boxes": _loop("\\boxed{} "),
    "boxes without an argument": _loop("\\boxed "),
    "doubled groups": _loop("{{(("),
}


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_every_verifier_is_fast_on_a_truncated_repetition_loop(loop):
    text = LOOPS[loop]
    for name in known_verifiers():
        verifier = get_verifier(name)
        best = min(_timed(verifier, text) for _ in range(3))
        assert best < 0.05, f"{name} took {best:.3f} s on a {len(text)}-character loop ({loop})"


def _timed(verifier, text: str) -> float:
    start = time.perf_counter()
    verifier(text, "3")
    return time.perf_counter() - start


# MindSpeed-RL's regexes: the specification the one-pass checks must match.
MINDSPEED_FORMAT = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL | re.MULTILINE)
MINDSPEED_LAYOUT = re.compile(r"<think>.*</think>.*<answer>.*\\boxed\{.*\}.*</answer>", re.DOTALL)  # fullmatch
MINDSPEED_BOXED = re.compile(r"\\boxed\{.*?\}")
# verl's geo3k.py / EasyR1's math.py format reward (re.fullmatch)
GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def test_one_pass_layout_checks_match_mindspeed_regexes():
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<answer>", "</answer>", "\\boxed{", "}", "x", " ", "\n"]
    for _ in range(4000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(12)))
        if rng.random() < 0.5:
            text = "<think>" + text
        assert loose_layout(text) == bool(MINDSPEED_FORMAT.match(text)), text
        assert r1_layout(text) == bool(MINDSPEED_LAYOUT.fullmatch(text)), text
        assert count_boxed(text, most=3) == min(3, len(MINDSPEED_BOXED.findall(text))), text
        assert get_verifier("geo3k_format")(text, "") == float(bool(GEO3K_FORMAT.fullmatch(text))), text


# --- registry and config -----------------------------------------------------------------------------------------

def test_unknown_verifier_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown verifier 'acuracy' .*known: acc, acc_for_dapo, acc_for_ppo, "):
        RewardScorer(RewardConfig(verifier_function=["acuracy"], verifier_weight=[1.0]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(verifier_function=["acc", "format"], verifier_weight=[1.0]), "has 2 entries but verifier_weight has 1"),
    (dict(verifier_function=[], verifier_weight=[]), "verifier_function is empty"),
    (dict(verifier_parallel=0), "verifier_parallel must be an integer >= 1"),
    (dict(verifier_timeout=0), "verifier_timeout must be a positive"),
    (dict(overlong_buffer_enable=True, overlong_buffer=4096, rollout_max_tokens=2048), "must be between 0 and"),
    (dict(verifier_fail_score=[-1.0, 0.0]), "verifier_fail_score has 2 entries but verifier_function has 1"),
    (dict(verifier_fail_score=["low"]), "must be finite numbers or null"),
    (dict(verifier_fail_score=-1.0), "must be a list with one entry per verifier"),
])
def test_config_mistakes_are_one_sentence(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RewardConfig(**kwargs)


def test_builtins_declare_their_worst_score():
    worst = {name: get_verifier(name).worst_score for name in known_verifiers()}
    assert worst == {"acc": -1.0, "acc_for_dapo": -1.0, "acc_for_ppo": 0.0, "answer_sentence": 0.0, "base_acc": 0.0,
                     "format": 0.0, "geo3k_acc": 0.0, "geo3k_format": 0.0, "gsm8k": 0.0, "math_17k_acc": 0.0,
                     "math_verify_reward": 0.0, "retool_reward": -1.0, "step": 0.0, "strict_format": -0.5,
                     "tool_call_bonus": 0.0, "tool_use_bonus": 0.0}


def test_weighted_total_and_per_verifier_metrics():
    with RewardScorer(RewardConfig(verifier_function=["acc", "format"], verifier_weight=[1.0, 0.5])) as scorer:
        result = scorer.score([R1.format(t="a", a="\\boxed{5}"), "\\boxed{4}", "nothing"], ["5", "5", "5"])
    assert result.rewards == [1.5, -0.5, -1.0]
    assert result.scores == {"acc": [1.0, -0.5, -1.0], "format": [1.0, 0.0, 0.0]}
    assert result.metrics["acc_rewards/mean"] == pytest.approx(-0.5 / 3)
    assert result.metrics["format_rewards/mean"] == pytest.approx(1 / 3)
    assert result.metrics["acc/timeout_fraction"] == 0 and result.metrics["format/error_fraction"] == 0


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(f"""
        import os
        import signal
        import time

        def length_bonus(response, label):
            return min(len(response), 10) / 10
        length_bonus.worst_score = 0.0

        def undeclared(response, label):
            return 1.0

        def slow(response, label):
            if "slow" in response:
                time.sleep(30)
            return 1.0
        slow.worst_score = -2.0

        def broken(response, label):
            if "boom" in response:
                raise RuntimeError("boom")
            if "nan" in response:
                return float("nan")
            return 1.0
        broken.worst_score = -3.0

        def stubborn(response, label):  # catches Exception around its waiting
            if "slow" in response:
                end = time.monotonic() + 30
                while time.monotonic() < end:
                    try:
                        time.sleep(0.01)
                    except Exception:
                        pass
            return 1.0
        stubborn.worst_score = -2.0

        def deaf(response, label):  # catches everything around a busy loop, or ignores the alarm
            if "busy" in response:
                while True:
                    try:
                        sum(range(1000))
                    except BaseException:
                        pass
            if "blind" in response:
                signal.signal(signal.SIGALRM, signal.SIG_IGN)
                time.sleep(30)
            return 1.0
        deaf.worst_score = -4.0

        def suicidal(response, label):
            if "die" in response:
                os._exit(3)
            return 1.0
        suicidal.worst_score = 0.0

        def dies_once(response, label):
            marker = {str(tmp_path / "died")!r}
            if "die" in response and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return 1.0
        dies_once.worst_score = 0.0
    """))
    return path


def test_custom_verifier_from_a_file_path(custom_file):
    config = RewardConfig(verifier_function=[f"{custom_file}:length_bonus"], verifier_weight=[2.0])
    with RewardScorer(config) as scorer:
        assert scorer.score(["abcde", "x" * 50], ["", ""]).rewards == [1.0, 2.0]


def test_custom_verifier_from_a_module_path():
    with RewardScorer(RewardConfig(verifier_function=["mindrl.rewards.verifiers:accuracy"],
                                   verifier_weight=[1.0])) as scorer:
        assert scorer.score(["\\boxed{3}"], ["3"]).rewards == [1.0]
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        RewardScorer(RewardConfig(verifier_function=["mindrl.rewards.verifiers:nope"], verifier_weight=[1.0]))


def test_a_custom_verifier_without_a_worst_score_needs_one_configured(custom_file):
    name = f"{custom_file}:undeclared"
    with pytest.raises(ConfigError, match=r"declares no worst score .* set its entry in verifier_fail_score"):
        RewardScorer(RewardConfig(verifier_function=["acc", name], verifier_weight=[1.0, 1.0]))
    scorer = RewardScorer(RewardConfig(verifier_function=["acc", name], verifier_weight=[1.0, 1.0],
                                       verifier_fail_score=[None, -1.0]))
    assert scorer.fail_scores == [-1.0, -1.0]


# --- failures score the worst, and the time limit holds -------------------------------------------------------

@pytest.mark.parametrize("parallel", [1, 2])
def test_timeouts_and_errors_score_the_worst_are_counted_and_the_batch_goes_on(custom_file, parallel):
    config = RewardConfig(verifier_function=[f"{custom_file}:slow", f"{custom_file}:broken"],
                          verifier_weight=[1.0, 1.0], verifier_timeout=0.5, verifier_parallel=parallel)
    with RewardScorer(config) as scorer:
        result = scorer.score(["fine", "slow one", "boom", "nan", "fine"], [""] * 5)
    assert result.rewards == [2.0, -1.0, -2.0, -2.0, 2.0]
    assert result.metrics[f"{custom_file}:slow/timeout_fraction"] == 0.2
    assert result.metrics[f"{custom_file}:broken/error_fraction"] == 0.4


def test_the_fail_score_can_be_configured(custom_file):
    config = RewardConfig(verifier_function=[f"{custom_file}:broken", "acc"], verifier_weight=[1.0, 1.0],
                          verifier_fail_score=[-10.0, None])
    with RewardScorer(config) as scorer:
        assert scorer.score(["boom \\boxed{5}"], ["5"]).scores == {f"{custom_file}:broken": [-10.0], "acc": [1.0]}


POWER_TOWER = "\\boxed{9^{9^{9^{9}}}}"


def _score_timed(config: RewardConfig, responses: list[str], labels: list[str]):
    with RewardScorer(config) as scorer:
        scorer.score(["\\boxed{1}"], ["1"])  # start the workers outside the timing
        start = time.monotonic()
        result = scorer.score(responses, labels)
        return result, time.monotonic() - start


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_power_tower_is_cut_off_at_the_limit(parallel):
    """It never finishes; the old alarm, an Exception, was swallowed by math-verify's `except Exception`."""
    config = RewardConfig(verifier_function=["acc", "format"], verifier_weight=[1.0, 0.5], verifier_timeout=0.5,
                          verifier_parallel=parallel)
    result, elapsed = _score_timed(config, ["\\boxed{4}", POWER_TOWER, R1.format(t="a", a="\\boxed{4}")],
                                   ["4", "4", "4"])
    assert result.scores == {"acc": [1.0, -1.0, 1.0], "format": [0.0, 0.0, 1.0]}
    assert result.metrics["acc/timeout_fraction"] == pytest.approx(1 / 3)
    assert elapsed < 0.5 + 1.0


def test_the_limit_holds_against_verifiers_that_catch_exceptions(custom_file):
    config = RewardConfig(verifier_function=[f"{custom_file}:stubborn", f"{custom_file}:deaf"],
                          verifier_weight=[1.0, 1.0], verifier_timeout=0.4)
    result, elapsed = _score_timed(config, ["ok", "slow", "busy", "blind", "ok"], [""] * 5)
    assert result.rewards == [2.0, -1.0, -3.0, -3.0, 2.0]
    assert result.metrics[f"{custom_file}:stubborn/timeout_fraction"] == 0.2
    assert result.metrics[f"{custom_file}:deaf/timeout_fraction"] == 0.4
    assert elapsed < 3 * 0.4 + 1.5


def test_the_limit_holds_outside_the_main_thread(custom_file):
    config = RewardConfig(verifier_function=["acc", f"{custom_file}:slow"], verifier_weight=[1.0, 1.0],
                          verifier_timeout=0.5)
    out = {}

    def run():
        out["timed"] = _score_timed(config, [POWER_TOWER, "slow \\boxed{3}", "\\boxed{3}"], ["3", "3", "3"])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    result, elapsed = out["timed"]
    assert result.rewards == [-1.0 + 1.0, 1.0 - 2.0, 2.0]
    assert elapsed < 2 * 0.5 + 1.5


# --- a worker that dies -------------------------------------------------------------------------------------

def test_a_worker_that_dies_once_is_replaced_and_the_batch_rescored(custom_file):
    config = RewardConfig(verifier_function=[f"{custom_file}:dies_once", "acc"], verifier_weight=[1.0, 1.0])
    with RewardScorer(config) as scorer:
        result = scorer.score(["\\boxed{1}", "die \\boxed{2}", "\\boxed{3}"], ["1", "2", "4"])
    assert result.rewards == [2.0, 2.0, 0.5]


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_worker_that_keeps_dying_raises_instead_of_zero_rewards(custom_file, parallel):
    config = RewardConfig(verifier_function=[f"{custom_file}:suicidal"], verifier_weight=[1.0],
                          verifier_parallel=parallel)
    with RewardScorer(config) as scorer:
        with pytest.raises(VerifierCrash, match=r"died twice in one batch .*suicidal' scored sample 1"):
            scorer.score(["ok", "die", "ok"], ["", "", ""])
        assert scorer.score(["ok", "ok"], ["", ""]).rewards == [1.0, 1.0]  # the next batch starts afresh


def test_a_worker_stopped_between_calls_is_replaced_and_the_batch_scored():
    """A verifier process stopped outside any call (SIGSTOP, a starved machine) has no call that overruns, so the
    time limit alone never fires and the scorer would wait for it forever: it must be replaced within about the
    limit and the batch scored in full."""
    with RewardScorer(RewardConfig(verifier_function=["acc"], verifier_weight=[1.0], verifier_timeout=0.5)) as scorer:
        scorer.score(["\\boxed{1}"], ["1"])  # the worker is up, waiting for work
        stopped = scorer._pool._children[0].process
        os.kill(stopped.pid, signal.SIGSTOP)
        out = {}
        thread = threading.Thread(target=lambda: out.update(result=scorer.score(["\\boxed{2}", "\\boxed{3}"],
                                                                                ["2", "4"])), daemon=True)
        start = time.monotonic()
        thread.start()
        thread.join(timeout=10)
        elapsed = time.monotonic() - start
        hung = thread.is_alive()
        if hung:  # unblock the scorer before failing
            os.kill(stopped.pid, signal.SIGKILL)
            thread.join(timeout=30)
    assert not hung, "the scorer waited for a stopped worker"
    assert out["result"].rewards == [1.0, -0.5] and elapsed < 0.5 + 2.0
    assert not stopped.is_alive()


def test_workers_score_like_the_verifiers_serially_and_in_parallel():
    pairs = [(c[1], c[2]) for c in CASES if c[0] == "acc"] * 3
    responses, labels = [p[0] for p in pairs], [p[1] for p in pairs]
    expected = [get_verifier("acc")(r, g) + 0.1 * get_verifier("format")(r, g) for r, g in pairs]
    common = dict(verifier_function=["acc", "format"], verifier_weight=[1.0, 0.1])
    with RewardScorer(RewardConfig(**common)) as serial, \
            RewardScorer(RewardConfig(**common, verifier_parallel=2)) as parallel:
        assert serial.score(responses, labels).rewards == expected
        assert parallel.score(responses, labels).rewards == expected


def test_an_empty_batch_scores_nothing():
    with RewardScorer(RewardConfig(verifier_function=["acc"], verifier_weight=[1.0])) as scorer:
        assert scorer.score([], []).rewards == []


@pytest.mark.parametrize("length, expected", [(0, 0.0), (1536, 0.0), (1792, -0.5), (2048, -1.0), (4000, -1.0)])
def test_overlong_penalty(length, expected):
    assert overlong_penalty(length, max_tokens=2048, buffer=512, factor=1.0) == pytest.approx(expected)


def test_overlong_penalty_is_added_and_reported():
    config = RewardConfig(verifier_function=["acc"], verifier_weight=[1.0], overlong_buffer_enable=True,
                          overlong_buffer=100, overlong_buffer_penalty_factor=0.5, rollout_max_tokens=300)
    with RewardScorer(config) as scorer:
        result = scorer.score(["\\boxed{1}", "\\boxed{1}"], ["1", "1"], response_lengths=[150, 250])
        assert result.rewards == [1.0, 0.75]
        assert result.metrics["overlong/fraction"] == 0.5
        with pytest.raises(ValueError, match="needs the token length"):
            scorer.score(["x"], ["1"])


@pytest.mark.job
def test_the_limit_holds_inside_the_trainers_ray_scorers(custom_file):
    """The driver scores on Ray actors (RuleRewards): there too a verifier that hangs or ignores the alarm
    scores its worst within the limit, counted, and one that kills its process once has the process replaced
    and the batch rescored; the scorer then serves the next batch."""
    import ray

    from mindrl.trainer.rewards import RuleRewards

    config = RewardConfig(verifier_function=[f"{custom_file}:deaf", f"{custom_file}:dies_once"],
                          verifier_weight=[1.0, 1.0], verifier_timeout=0.5)
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        rule = RuleRewards(config, num_cpus=0)
        rule.collect(rule.submit(["warm up"], [""], [2]))  # the actor's start outside the timing
        start = time.monotonic()
        result = rule.collect(rule.submit(["ok", "busy", "blind", "die", "ok"], [""] * 5, [1] * 5))
        elapsed = time.monotonic() - start
        after = rule.collect(rule.submit(["ok", "die"], [""] * 2, [1] * 2))
        rule.close()
    finally:
        ray.shutdown()
    assert result.rewards == [2.0, -3.0, -3.0, 2.0, 2.0]
    assert result.metrics[f"{custom_file}:deaf/timeout_fraction"] == 0.4
    assert elapsed < 3 * 0.5 + 3.0
    assert after.rewards == [2.0, 2.0]


def _gone(pid: int, within_s: float) -> bool:
    """Whether process `pid` has ended (or is a zombie) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.job
def test_a_ray_scorer_that_stops_answering_ends_the_phase_at_its_deadline_naming_it():
    """A scorer stopped whole (SIGSTOP: the verifier processes' limits live inside it) held the step forever: the
    rule_reward phase's deadline (rl_config.phase_timeout) must name it and its node, closing must still end,
    and the stopped process must be gone."""
    import ray

    from mindrl.trainer.rewards import RuleRewards
    from mindrl.workers.group import PhaseTimeout

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        rule = RuleRewards(RewardConfig(verifier_function=["acc"], verifier_weight=[1.0]), num_cpus=0,
                           phase_timeout_s=3)
        ray.get(rule.submit(["\\boxed{1}"], ["1"], [2])[1])  # its start and first scoring outside the deadline
        pid = ray.get(rule.actors[0].__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(PhaseTimeout, match=r"^rule-reward scorer 0 of 1 on node \S+ \(\w{8}\) did not finish the "
                                               r"rule_reward phase within 3 s .*actor_config\.load"):
            rule.collect(rule.submit(["\\boxed{2}"], ["2"], [2]))
        waited = time.monotonic() - start
        rule.close()
        closed = time.monotonic() - start - waited
        gone = _gone(pid, 15)
        if not gone:
            os.kill(pid, signal.SIGKILL)
    finally:
        ray.shutdown()
    assert 3 <= waited < 3 + 2 and closed < 10, (waited, closed)
    assert gone, "the stopped scorer outlived its close"
