"""Finding the final answer in a response.

Only the response is ever searched: if the decoded text still carries the prompt, the part
up to the last assistant-turn header is dropped, with the newlines the template puts after
the header (they are the template's, not the policy's: leaving one of llama3's two made
every llama3 response fail the tag layout), so a \\boxed{} or <answer> tag quoted in the
prompt can never earn reward.

Every search here is linear in the length of the text. A truncated repetition loop is the
common long response, and a backtracking regex spends the whole time limit on each one.
"""

from __future__ import annotations

import re

from mindrl.rewards.normalise import plain_characters

# The assistant-turn header of each chat template in configs/model/templates.json (and of the
# tokenizer chat templates of the same families), with what the template writes after it.
ASSISTANT_HEADERS = (
    ("<|im_start|>assistant", "\n"),
    ("<|start_header_id|>assistant<|end_header_id|>", "\n\n"),
    ("<｜Assistant｜>", ""),
)
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<｜end▁of▁sentence｜>")

# A thousands-grouped number may not start right after "digit,": inside a long comma chain
# every such start would rescan the rest of the chain.
_NUMBER = re.compile(r"(?<!\d,)-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d|,\d)|-?\d+/\d+|-?\d+(?:\.\d+)?|-?\.\d+")
_BRACES = re.compile(r"[{}]")
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# What an unbraced \boxed takes: a number (the digits a policy means, where TeX would take one) or a command.
_TOKEN = re.compile(r"-?\d+(?:\.\d+)?|\\(?!(?:boxed|fbox)(?![A-Za-z]))[A-Za-z]+")


def response_only(text: str) -> str:
    """The assistant's part of a decoded sequence, without end-of-turn tokens."""
    start, after = 0, ""
    for header, template_suffix in ASSISTANT_HEADERS:
        found = text.rfind(header)
        if found >= 0 and found + len(header) > start:
            start, after = found + len(header), template_suffix
    text = text[start:].removeprefix(after)
    for marker in END_MARKERS:
        cut = text.find(marker)
        if cut >= 0:
            text = text[:cut]
    return text


def last_boxed(text: str) -> str | None:
    """The argument of the last \\boxed (or \\fbox) that has one: a braced group, nested braces matched,
    or, as TeX reads `\\boxed 5`, a number or command right after it. A box without an argument (an
    empty `\\boxed{}`, or the word in prose: `put it in \\boxed.`) is passed over for the one before;
    an unclosed last group means no answer (the response was cut off mid-answer). None if none."""
    for command in reversed(list(_BOX.finditer(text))):
        start = command.end()
        while start < len(text) and text[start].isspace():
            start += 1
        if text.startswith("{", start):
            depth = 0
            for match in _BRACES.finditer(text, start):
                depth += 1 if match.group() == "{" else -1
                if depth == 0:
                    break
            else:
                return None
            argument = text[start + 1:match.start()].strip()
        else:
            token = _TOKEN.match(text, start)
            argument = token.group(0) if token else ""
        if argument:
            return argument
    return None


def answer_tag(text: str) -> str | None:
    """Content of the last complete <answer>...</answer> (each tag closed by the next </answer>)."""
    found, position = None, 0
    while (opening := text.find("<answer>", position)) >= 0:
        closing = text.find("</answer>", opening + 8)
        if closing < 0:
            break
        found, position = text[opening + 8:closing], closing + 9
    return found.strip() if found is not None else None


def answer_regions(text: str) -> tuple[str, ...]:
    """Where to look for the final answer, in order: what follows the last `</think>` (so a guess the
    policy dropped while thinking is not taken for it), then the whole text for a response that answers
    only while thinking; just the text when there is no `</think>`."""
    end = text.rfind("</think>")
    return (text,) if end < 0 else (text[end + len("</think>"):], text)


def final_boxed(text: str) -> str | None:
    """The last boxed answer of the first answer region that has one."""
    return next((boxed for part in answer_regions(text) if (boxed := last_boxed(part)) is not None), None)


def extract_answer(response: str) -> str | None:
    """The final answer of a response: its last \\boxed{}, else its last <answer> tag — searched after
    the thinking first, then (for a response that answers only inside it) in the whole text."""
    text = response_only(response)
    for part in answer_regions(text):
        boxed = last_boxed(part)
        if boxed is not None:
            return boxed
        tagged = answer_tag(part)
        if tagged:
            return None if _BOX.search(tagged) else tagged  # a box in the tag without an argument is no answer
    return None


def gsm8k_answer(response: str) -> str | None:
    """GSM8K convention: the text after the last `####`, else the last number in the response —
    searched by answer_regions."""
    text = plain_characters(response_only(response)).replace("{,}", ",")  # `−12` keeps its sign; LaTeX's `1{,}234`
    for part in answer_regions(text):
        if "####" in part:
            tail = part.rsplit("####", 1)[1].strip()
            number = _NUMBER.search(tail.replace("$", ""))
            return number.group(0) if number else (tail or None)
        numbers = _NUMBER.findall(part)
        if numbers:
            return numbers[-1]
    return None


def reference_answer(label: str) -> str:
    """The reference from a dataset label (GSM8K labels carry their working before `####`)."""
    return label.rsplit("####", 1)[1].strip() if "####" in label else label.strip()
