"""Finding a final answer in a response and deciding whether it equals the reference.

Only the response is ever searched: if the decoded text still carries the prompt, the
part up to the last assistant-turn marker is dropped, so a \\boxed{} or an <answer> tag
quoted in the prompt can never earn reward. Equality is mathematical (math-verify: 0.5
equals 1/2 equals \\frac{1}{2}), after removing what is not the number: thousands
separators, `$`, `\\text{...}` units and trailing words.
"""

from __future__ import annotations

import logging
import re

from math_verify import parse, verify

# math-verify warns on every call that timeouts are ours to enforce: the scorer does that
# (a per-sample time limit around each verifier), so the warning says nothing.
logging.getLogger("math_verify").setLevel(logging.ERROR)

ASSISTANT_MARKERS = ("<|im_start|>assistant", "<|start_header_id|>assistant<|end_header_id|>", "<｜Assistant｜>")
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>", "<｜end▁of▁sentence｜>")

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,])|-?\d+(?:\.\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"(?<![\d.])(-?\d{1,3}(?:,\d{3})+)(?![\d,])")
_TEXT_UNITS = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{[^{}]*\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def response_only(text: str) -> str:
    """The assistant's part of a decoded sequence, without end-of-turn tokens."""
    for marker in ASSISTANT_MARKERS:
        if marker in text:
            text = text.rsplit(marker, 1)[1].removeprefix("\n")  # the newline after the role is the template's
    for marker in END_MARKERS:
        text = text.split(marker, 1)[0]
    return text


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), nested braces matched; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0 or text[start:brace].strip() not in ("\\boxed", "\\fbox"):
        return None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1:i].strip()
    return None


def answer_tag(text: str) -> str | None:
    """Content of the last complete <answer>...</answer>; None if there is none."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def extract_answer(response: str) -> str | None:
    """The final answer of a response: its last \\boxed{}, else its last <answer> tag."""
    text = response_only(response)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    tagged = answer_tag(text)
    if tagged:
        return last_boxed(tagged) or tagged
    return None


def gsm8k_answer(response: str) -> str | None:
    """GSM8K convention: the text after the last `####`, else the last number in the response."""
    text = response_only(response)
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        number = _NUMBER.search(tail.replace("$", ""))
        return number.group(0) if number else (tail or None)
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def reference_answer(label: str) -> str:
    """The reference from a dataset label (GSM8K labels carry their working before `####`)."""
    return label.rsplit("####", 1)[1].strip() if "####" in label else label.strip()


def clean(answer: str) -> str:
    """Remove what is not the value: `$`, units in \\text{}, thousands separators, a trailing period."""
    answer = answer.strip().strip("$").strip()
    answer = _TEXT_UNITS.sub("", answer)
    answer = _THOUSANDS.sub(lambda m: m.group(1).replace(",", ""), answer)
    answer = answer.replace("\\!", "").replace("\\,", "").replace("\\ ", "")
    return answer.rstrip(".").strip()


def _as_number(answer: str) -> float | None:
    """The value of a plain number with at most some words around it ('72 dollars', '-3')."""
    numbers = _NUMBER.findall(answer)
    if len(numbers) != 1:
        return None
    try:
        return float(numbers[0].replace(",", ""))
    except ValueError:
        return None


def answers_equal(predicted: str | None, reference: str) -> bool:
    """Mathematical equality of a predicted answer and the reference."""
    if predicted is None or not predicted.strip():
        return False
    pred, gold = clean(predicted), clean(reference_answer(reference))
    if pred == gold:
        return True
    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    pred_parsed = parse(f"${pred}$", parsing_timeout=None)
    if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None):
        return True
    pred_value, gold_value = _as_number(pred), _as_number(gold)
    if pred_value is not None and gold_value is not None:
        return abs(pred_value - gold_value) <= 1e-9 * max(1.0, abs(gold_value))
    return False
