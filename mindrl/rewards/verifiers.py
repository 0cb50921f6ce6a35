"""Built-in verifiers, with MindSpeed-RL's names and scores.

| name | checks | score | worst |
|---|---|---|---|
| acc | last \\boxed{} (or <answer> tag) equals the label | 1.0 equal, -0.5 wrong, -1.0 no answer | -1.0 |
| math_17k_acc | last \\boxed{} equals the label | 1.0 / 0.0 | 0.0 |
| acc_for_ppo | the same check as math_17k_acc (MindSpeed-RL's PPO name for it) | 1.0 / 0.0 | 0.0 |
| acc_for_dapo | DAPO's: the last `Answer:` line of the last 300 characters, Minerva-normalised | 1.0 / -1.0 | -1.0 |
| math_verify_reward | base_acc's layout, and math-verify's math_metric finds the label | 1.0 / 0.0 | 0.0 |
| step | step markers (`Step 1:`, a bullet, `First,` …), a third each | min(1, markers / 3) | 0.0 |
| base_acc | R1 layout (see strict layout below) and boxed answer equal | 1.0 / 0.0 | 0.0 |
| format | <think>…</think> then <answer>…</answer> at a line end | 1.0 / 0.0 | 0.0 |
| strict_format | one of each tag and one \\boxed, in order, nothing outside | 1.0 / -0.5 | -0.5 |
| gsm8k | number after the last `####` (else the last number) equals the label | 1.0 / 0.0 | 0.0 |
| geo3k_acc | the last \\boxed{} of the response equals the label (verl's and EasyR1's) | 1.0 / 0.0 | 0.0 |
| geo3k_format | `<think>…</think>…\\boxed{…}…`, the whole response (their format reward) | 1.0 / 0.0 | 0.0 |
| tool_call_bonus | the number of tool calls k (verifier_weight is the reward per call) | k | 0.0 |
| tool_use_bonus | at least one tool call (verl's flag; verifier_weight is the reward for using it) | 1.0 / 0.0 | 0.0 |
| retool_reward | last \\boxed{} of the last 100 characters is the label string | 1.0 / min(0, -1 + 0.1·k) | -1.0 |

The last three read the sample's number of tool calls, k (0 in a single-turn run).

acc, math_17k_acc (acc_for_ppo), base_acc, geo3k_acc and gsm8k grade by mathematical equality (see equality);
acc, math_17k_acc and gsm8k look after the last `</think>` first, so that a guess the policy dropped while
thinking is not graded in place of its final answer (the whole response when there is none). acc_for_dapo,
math_verify_reward, retool_reward and step are MindSpeed-RL's checks as they are, applied to the response
alone: recipes were tuned against their notion of right, quirks included.
A sample that times out or raises gets the verifier's worst score (MindSpeed-RL gives 0.0,
which under `acc` beats a wrong answer: a policy would learn to make the verifier time out).
The layout checks are plain scans that give the same verdicts as MindSpeed-RL's regexes
without their backtracking, which takes seconds on a truncated repetition loop.
"""

from __future__ import annotations

import re
from functools import lru_cache
from itertools import islice

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from mindrl.rewards.answers import extract_answer, final_boxed, gsm8k_answer, last_boxed, response_only
from mindrl.rewards.equality import answers_equal
from mindrl.rewards.minerva import normalise_final_answer
from mindrl.rewards.registration import register_verifier

_THINK_THEN_ANSWER = re.compile(r"</think>\s*<answer>")
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def loose_layout(text: str) -> bool:
    """MindSpeed-RL's `^<think>.*?</think>\\s*<answer>.*?</answer>$` (dot-all, multi-line), in one pass."""
    found = _THINK_THEN_ANSWER.search(text, 7) if text.startswith("<think>") else None
    if found is None:
        return False
    position = found.end()
    while (closing := text.find("</answer>", position)) >= 0:
        end = closing + 9
        if end == len(text) or text[end] == "\n":
            return True
        position = closing + 1
    return False


def r1_layout(text: str) -> bool:
    """MindSpeed-RL's `re.fullmatch` of `<think>.*</think>.*<answer>.*\\\\boxed\\{.*\\}.*</answer>` (dot-all), in
    one pass: the whole response, nothing after `</answer>` (not even a newline, which `$` would have let by)."""
    if not text.startswith("<think>") or not text.endswith("</answer>"):
        return False
    position, limit = 7, len(text) - 9
    for token in ("</think>", "<answer>", "\\boxed{", "}"):
        found = text.find(token, position, limit)
        if found < 0:
            return False
        position = found + len(token)
    return True


def count_boxed(text: str, most: int) -> int:
    """Matches of `\\\\boxed\\{.*?\\}` (a `}` later on the same line), counting up to `most`."""
    count, position, line_end = 0, 0, -1
    while count < most and (start := text.find("\\boxed{", position)) >= 0:
        if start > line_end:
            line_end = text.find("\n", start)
            line_end = len(text) if line_end < 0 else line_end
        closing = text.find("}", start + 7, line_end)
        if closing < 0:  # no later \boxed{ on this line can close either
            position = line_end
            continue
        count, position = count + 1, closing + 1
    return count


@register_verifier("acc", worst_score=-1.0)
def accuracy(response: str, label: str) -> float:
    answer = extract_answer(response)
    if answer is None:
        return -1.0
    return 1.0 if answers_equal(answer, label) else -0.5


@register_verifier("acc_for_ppo", worst_score=0.0)
@register_verifier("math_17k_acc", worst_score=0.0)
def boxed_accuracy(response: str, label: str) -> float:
    """One check under two names: in MindSpeed-RL both grade the last box with mathruler, the same call."""
    return 1.0 if answers_equal(final_boxed(response_only(response)), label) else 0.0


_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


@register_verifier("acc_for_dapo", worst_score=-1.0)
def dapo_accuracy(response: str, label: str) -> float:
    """DAPO's (and verl's math_dapo) check: in the last 300 characters, the rest of the line after the last
    `Answer:` must equal the label once both are Minerva-normalised (see minerva), as strings."""
    answers = _DAPO_ANSWER.findall(response_only(response)[-300:])
    predicted = answers[-1] if answers else "[INVALID]"
    return 1.0 if normalise_final_answer(predicted) == normalise_final_answer(label) else -1.0


_GOLD_TARGETS = (LatexExtractionConfig(),)
_PREDICTION_TARGETS = (ExprExtractionConfig(), LatexExtractionConfig())


@lru_cache(maxsize=4096)
def _boxed_gold(label: str) -> tuple:
    """A label as math_metric reads it (labels repeat across the samples of a group: parsed once)."""
    return tuple(parse("\\boxed{" + label + "}", _GOLD_TARGETS, parsing_timeout=None))


@register_verifier("math_verify_reward", worst_score=0.0)
def math_verify_accuracy(response: str, label: str) -> float:
    """MindSpeed-RL's: base_acc's layout, then math-verify's math_metric as MindSpeed-RL configures it (the
    label read as `\\boxed{label}`, the whole response as an expression or LaTeX). math_metric's core without
    its own alarms, which the worker pool replaces. An unreadable label scores 0.0, as MindSpeed-RL's catching
    math_metric's error does; any other error the pool scores 0.0 too (the worst), and counts it."""
    text = response_only(response)
    if not r1_layout(text):
        return 0.0
    gold = _boxed_gold(label)
    if not gold:
        return 0.0
    predicted = parse(text, _PREDICTION_TARGETS, parsing_timeout=None)
    return 1.0 if verify(list(gold), predicted, timeout_seconds=None) else 0.0


@register_verifier("base_acc", worst_score=0.0)
def layout_and_accuracy(response: str, label: str) -> float:
    text = response_only(response)
    if not r1_layout(text):
        return 0.0
    return 1.0 if answers_equal(last_boxed(text), label) else 0.0


@register_verifier("format", worst_score=0.0)
def loose_format(response: str, label: str) -> float:
    return 1.0 if loose_layout(response_only(response)) else 0.0


@register_verifier("strict_format", worst_score=-0.5)
def strict_format(response: str, label: str) -> float:
    text = response_only(response)
    if any(text.count(tag) != 1 for tag in _TAGS) or count_boxed(text, most=2) != 1:
        return -0.5
    order = [text.find("<think>"), text.find("</think>"), text.find("<answer>"), text.find("\\boxed"),
             text.find("</answer>")]
    if order != sorted(order) or not text.startswith("<think>") or not text.endswith("</answer>"):
        return -0.5
    return 1.0


@register_verifier("gsm8k", worst_score=0.0)
def gsm8k_numeric(response: str, label: str) -> float:
    return 1.0 if answers_equal(gsm8k_answer(response), label) else 0.0


_STEP_MARKERS = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")


@register_verifier("step", worst_score=0.0)
def reasoning_steps(response: str, label: str) -> float:
    """MindSpeed-RL's reasoning_steps_reward: a third per step marker, full at three. Without re.MULTILINE its
    `^\\d+\\.` counts a numbered line only at the very start; read on the response alone, not the prompt."""
    return len(list(islice(_STEP_MARKERS.finditer(response_only(response)), 3))) / 3  # markers past 3 add nothing


_ANSWER_SENTENCE = re.compile(r"The answer is -?\d+(?:\.\d+)?\.")


@register_verifier("answer_sentence", worst_score=0.0)
def answer_sentence_format(response: str, label: str) -> float:
    """The CPU learning demo's answer layout: the whole response is `The answer is N.`"""
    return 1.0 if _ANSWER_SENTENCE.fullmatch(response_only(response).strip()) else 0.0


@register_verifier("geo3k_acc", worst_score=0.0)
def geometry_accuracy(response: str, label: str) -> float:
    """verl's and EasyR1's Geometry3K accuracy: the last \\boxed{} anywhere in the response, graded."""
    return 1.0 if answers_equal(last_boxed(response_only(response)), label) else 0.0


@register_verifier("geo3k_format", worst_score=0.0)
def think_then_boxed(response: str, label: str) -> float:
    """Their format reward, `<think>.*</think>.*\\boxed\\{.*\\}.*` matching the whole response (dot-all), as one
    scan: the earliest `</think>` after the opening tag leaves the most room for a box after it."""
    text = response_only(response)
    if not text.startswith("<think>"):
        return 0.0
    closing = text.find("</think>", 7)
    box = text.find("\\boxed{", closing + 8) if closing >= 0 else -1
    return 1.0 if box >= 0 and text.find("}", box + 7) >= 0 else 0.0


@register_verifier("tool_call_bonus", worst_score=0.0)
def tool_call_bonus(response: str, label: str, tool_calls: int = 0) -> float:
    """The number of tool calls, to be weighted: without a reward for calling, a multi-turn policy soon stops
    calling its tool and guesses (verl issue 1569; verl's fix, +0.1 for a trajectory with at least one call, took
    GSM8K from 0.608 to 0.717). This one pays per call; the rollout's cap on calls bounds it."""
    return float(tool_calls)


@register_verifier("tool_use_bonus", worst_score=0.0)
def tool_use_bonus(response: str, label: str, tool_calls: int = 0) -> float:
    """verl's fix of the same (issue 1569) as it is: 1.0 for a trajectory that made at least one call, however
    many; weighted by verifier_weight (verl's 0.1). It rewards using the tool, not calling it again and again."""
    return 1.0 if tool_calls > 0 else 0.0


@register_verifier("retool_reward", worst_score=-1.0)
def retool_reward(response: str, label: str, tool_calls: int = 0) -> float:
    """MindSpeed-RL's ReTool reward: the last \\boxed{} within the last 100 characters must be the label exactly
    (1.0). A wrong answer's -1.0 is softened by 0.1 per tool call, so that a policy is not pushed off the tool while
    its calls do not yet pay; capped at 0.0, so a wrong answer earns nothing however many calls it makes."""
    if last_boxed(response_only(response)[-100:]) == label:
        return 1.0
    return min(0.0, (tool_calls - 10) / 10)  # -1 + 0.1·k, written so that each step is the decimal it means
