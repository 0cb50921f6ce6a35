"""Deciding whether a predicted answer equals the reference.

The steps, cheapest first. Each says "equal" only when it is sure; a cheap step says "not
equal" only for two integers (math-verify could say nothing else) and for word answers
(which math-verify misreads):

1. the same canonical spelling (see normalise): equal;
2. both plain numbers (integer, decimal, a/b, \\frac{a}{b}): equal when the values are;
   two integers are decided either way (by their digits, so a 10k-digit loop costs nothing);
3. a word answer on either side (`\\text{yes}`, `\\text{North}`): both sides compare by
   their words, ignoring case; math-verify reads a bare word as a product of symbols
   (`yes` = `sey`), so it must not decide these;
4. one number with only words around it (`72 dollars`, `\\$18`, `so it is 12`): equal when
   the numbers are, unless a word changes the value (`negative 3`, `3 million`) — a LaTeX
   command, operator, bracket, second number or one-letter variable never qualifies;
5. math-verify (LaTeX parsing, then numeric and symbolic equality) decides the rest.

Labels repeat across the samples of a GRPO group and policies repeat answers, so the work
on each distinct label, answer and pair is done once per process (bounded caches; very
long answers, such as a repetition loop inside a \\boxed{}, are not kept).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from math_verify import parse, verify

from mindrl.rewards.answers import reference_answer
from mindrl.rewards.normalise import canonical, tidy

# math-verify warns on every call that timeouts are the caller's to enforce: the scorer does
# that (worker processes with a watchdog), so the warning says nothing.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_CACHED_LENGTH = 1000
_NUMBER = re.compile(r"(-?)(?:(\d+)|(\d*\.\d+)|(-?\d+)/(\d+)|\\frac\{(-?\d+)\}\{(\d+)\}|\\frac(\d)(\d))")
_WRAPPED_WORDS = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mbox)\{([A-Za-z][A-Za-z' -]*)\}")
_PLAIN_WORDS = re.compile(r"[A-Za-z][A-Za-z' -]*")
_TWO_LETTERS = re.compile(r"[A-Za-z]{2}")
_QUANTITY = re.compile(r"((?:[A-Za-z]{2,} )*(?:[A-Za-z]{2,}: ?)?)(?:\\\$ ?|[€£¥₹] ?)?(-?(?:\d+(?:\.\d+)?|\.\d+))"
                       r"((?: [A-Za-z]{2,})*)")
# Words that change a number's value or say something other than "it is this number".
_VALUE_WORDS = frozenset("""
    negative minus plus not no never less more fewer greater smaller larger than least most over under above below
    about approximately approx around roughly nearly almost between and or to up from except times divided point
    squared cubed square cube root sqrt half halves third thirds quarter quarters fourths fifths sixths sevenths
    eighths ninths tenths hundredths thousandths percent percentage pct dozen dozens hundred hundreds thousand
    thousands million millions billion billions trillion trillions pi log ln exp sin cos tan cot sec csc inf
    infinity infty factorial power mod modulo
""".split())


@dataclass(frozen=True, slots=True)
class _Answer:
    text: str
    value: Fraction | None = None
    integer: str | None = None  # sign and digits without leading zeros: no int() limit on its length
    words: str | None = None
    wrapped: bool = False
    quantity: Fraction | None = None


def _fraction(match: re.Match[str]) -> Fraction | None:
    sign, integer, decimal, num, den, frac_num, frac_den, short_num, short_den = match.groups()
    try:
        if integer or decimal:
            value = Fraction(integer or decimal)
        else:
            value = Fraction(int(num or frac_num or short_num), int(den or frac_den or short_den))
    except (ValueError, ZeroDivisionError):  # a zero denominator, or more digits than int() takes
        return None
    return -value if sign else value


def _build(raw: str) -> _Answer:
    tidied = tidy(raw)
    text = canonical(tidied)
    number = _NUMBER.fullmatch(text)
    if number:
        value = _fraction(number)
        digits = number.group(2).lstrip("0") if number.group(2) else None
        integer = None if digits is None else f"{number.group(1)}{digits}" if digits else "0"
        return _Answer(text, value=value, integer=integer, quantity=value)
    wrapped = _WRAPPED_WORDS.fullmatch(text)
    words = wrapped.group(1) if wrapped else text if _PLAIN_WORDS.fullmatch(text) else None
    if words is not None and _TWO_LETTERS.search(words):
        return _Answer(text, words=" ".join(words.lower().split()), wrapped=wrapped is not None)
    quantity = _QUANTITY.fullmatch(tidied)
    if quantity and _VALUE_WORDS.isdisjoint(re.findall("[a-z]+", (quantity.group(1) + quantity.group(3)).lower())):
        try:
            return _Answer(text, quantity=Fraction(quantity.group(2)))
        except ValueError:
            pass
    return _Answer(text)


_build_cached = lru_cache(maxsize=16384)(_build)


def _answer(raw: str) -> _Answer:
    return _build_cached(raw) if len(raw) <= _CACHED_LENGTH else _build(raw)


@lru_cache(maxsize=4096)
def _reference(label: str) -> _Answer:
    return _build(reference_answer(label))


def _parse(text: str) -> tuple:
    return tuple(parse(f"${text}$", parsing_timeout=None))


_parse_cached = lru_cache(maxsize=8192)(_parse)


def _math_verify_equal(gold: str, pred: str) -> bool:
    gold_parsed = _parse_cached(gold)
    pred_parsed = _parse_cached(pred) if len(pred) <= _CACHED_LENGTH else _parse(pred)
    return bool(gold_parsed and pred_parsed and verify(list(gold_parsed), list(pred_parsed), timeout_seconds=None))


_math_verify_equal_cached = lru_cache(maxsize=16384)(_math_verify_equal)


def answers_equal(predicted: str | None, reference: str) -> bool:
    """Mathematical equality of a predicted answer and the reference (a label, `####` allowed)."""
    if predicted is None:
        return False
    pred, gold = _answer(predicted), _reference(reference)
    if not pred.text or not gold.text:
        return False
    if pred.text == gold.text:
        return True
    if pred.integer is not None and gold.integer is not None:
        return pred.integer == gold.integer
    if pred.value is not None and pred.value == gold.value:
        return True
    if pred.wrapped or gold.wrapped:
        return pred.words is not None and pred.words == gold.words
    if pred.quantity is not None and pred.quantity == gold.quantity:
        return True
    if len(pred.text) > _CACHED_LENGTH:
        return _math_verify_equal(gold.text, pred.text)
    return _math_verify_equal_cached(gold.text, pred.text)
