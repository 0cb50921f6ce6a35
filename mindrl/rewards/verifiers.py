"""Built-in verifiers, with MindSpeed-RL's names and scores.

| name | checks | score |
|---|---|---|
| acc | last \\boxed{} (or <answer> tag) equals the label | 1.0 equal, -0.5 wrong, -1.0 no answer |
| math_17k_acc | last \\boxed{} equals the label | 1.0 / 0.0 |
| base_acc | R1 layout (see strict layout below) and boxed answer equal | 1.0 / 0.0 |
| format | <think>…</think> then <answer>…</answer> at a line end | 1.0 / 0.0 |
| strict_format | one of each tag and one \\boxed, in order, nothing outside | 1.0 / -0.5 |
| gsm8k | number after the last `####` (else the last number) equals the label | 1.0 / 0.0 |

Timeouts and exceptions score 0.0 in the scorer, whatever the verifier.
"""

from __future__ import annotations

import re

from mindrl.rewards.answers import answers_equal, extract_answer, gsm8k_answer, last_boxed, response_only
from mindrl.rewards.registry import register_verifier

_FORMAT = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL | re.MULTILINE)
_LAYOUT = re.compile(r"^<think>.*</think>.*<answer>.*\\boxed\{.*\}.*</answer>$", re.DOTALL)


@register_verifier("acc")
def accuracy(response: str, label: str) -> float:
    answer = extract_answer(response)
    if answer is None:
        return -1.0
    return 1.0 if answers_equal(answer, label) else -0.5


@register_verifier("math_17k_acc")
def boxed_accuracy(response: str, label: str) -> float:
    return 1.0 if answers_equal(last_boxed(response_only(response)), label) else 0.0


@register_verifier("base_acc")
def layout_and_accuracy(response: str, label: str) -> float:
    text = response_only(response)
    if not _LAYOUT.match(text):
        return 0.0
    return 1.0 if answers_equal(last_boxed(text), label) else 0.0


@register_verifier("format")
def loose_format(response: str, label: str) -> float:
    return 1.0 if _FORMAT.match(response_only(response)) else 0.0


@register_verifier("strict_format")
def strict_format(response: str, label: str) -> float:
    text = response_only(response)
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    if any(text.count(tag) != 1 for tag in tags) or len(re.findall(r"\\boxed\{.*?\}", text)) != 1:
        return -0.5
    order = [text.find("<think>"), text.find("</think>"), text.find("<answer>"), text.find("\\boxed"),
             text.find("</answer>")]
    if order != sorted(order) or not text.startswith("<think>") or not text.endswith("</answer>"):
        return -0.5
    return 1.0


@register_verifier("gsm8k")
def gsm8k_numeric(response: str, label: str) -> float:
    return 1.0 if answers_equal(gsm8k_answer(response), label) else 0.0
