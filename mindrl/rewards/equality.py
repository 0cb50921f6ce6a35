"""Deciding whether a predicted answer equals the reference.

The steps, cheapest first. Each says "equal" only when it is sure; a cheap step says "not
equal" only for two integers (math-verify could say nothing else) and for word answers
(which math-verify misreads):

1. the same canonical spelling (see normalise): equal;
2. both plain numbers (integer, decimal, a/b, \\frac{a}{b}): equal when the values are;
   two integers are decided either way (by their digits, so a 10k-digit loop costs nothing);
3. a multiple-choice label (`B`, `(B)`): the letter the answer picks (`\\text{Option B}`,
   `(B) 12`) when it names one;
4. a word answer on either side (`\\text{yes}`, `\\textbf{\\text{Yes.}}`, `North`): both sides
   compare by their words, ignoring case and the punctuation around them; math-verify reads a
   bare word as a product of symbols (`yes` = `sey`), so it must not decide these;
5. one number with only words around it (`72 dollars`, `\\$18`, `\\text{5 cm}`, `so it is 12`):
   its value decides, `negative`/`minus` before it and `dozen` … `trillion` after it included
   (`3 million` is 3000000), and two units must name the same one (`5 ft` is `5 feet`, `5 cm`
   is not `5 m`). Only a few filler words may stand before the number; any other word that
   changes the value (`1 fifth`, `twice 5`, `about 12`) makes it equal to no number. A LaTeX
   command, operator, bracket, second number or one-letter variable never qualifies;
6. math-verify (LaTeX parsing, then numeric and symbolic equality) decides the rest.

Labels repeat across the samples of a GRPO group and policies repeat answers, so the work
on each distinct label, answer and pair is done once per process (bounded caches; very
long answers, such as a repetition loop inside a \\boxed{}, are not kept).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
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
# 0.\\overline{3} = 1/3: the repeating digits over as many nines (math-verify reads no \\overline)
_REPEATING = re.compile(r"(-?)(\d*)\.(\d*)\\overline\{(\d{1,50})\}")
_WRAPPER = re.compile(r"\\(?:text|textbf|textit|textrm|textsf|texttt|mathrm|mathbf|mbox|emph)\{([^{}]*)\}")
_WORDS = re.compile(r"[A-Za-z][A-Za-z' -]*")
_TWO_LETTERS = re.compile(r"[A-Za-z]{2}")
_PUNCTUATION = " .,;:!?()'\""
_CHOICE_LABEL = re.compile(r"\(?([A-J])\)?")
# A letter, then maybe the option's text, but not a second option (`(A) or (B)` picks neither).
_CHOICE = re.compile(r"(?:(?:the )?(?:option|choice|answer)(?: is)? ?:? ?)?(?:\(([A-J])\)|([A-J])(?:[.):])?)"
                     r"(?: (?!.*\([A-J]\))(?!.*\b(?:or|and)\b).*)?", re.IGNORECASE)
# Lead-in words, or a label ending in a colon (`Total cost: 18`); currency; the number; words after it.
_QUANTITY = re.compile(r"(?:(?:[A-Za-z]{2,} )*[A-Za-z]{2,}: ?|((?:[A-Za-z]{2,} )*))(\\\$ ?|[€£¥₹] ?)?"
                       r"(-?(?:\d+(?:\.\d+)?|\.\d+))((?: [A-Za-z]+)*)")
_CURRENCY = {"\\$": "dollar", "€": "euro", "£": "pound", "¥": "yen", "₹": "rupee"}
# What may stand before a number that is the answer: "so it is 12", "the answer is 12".
_FILLER = frozenset("the answer answers final result total value is are so thus therefore hence it we get equals "
                    "equal to of exactly".split())
_NEGATIONS = frozenset({"negative", "minus"})
# Words after a number that multiply it: `3 million` is 3000000.
_SCALES = {"dozen": 12, "hundred": 100, "thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}
# Words around a number that change its value in a way not worked out here, or say it is not this number.
_VALUE_WORDS = frozenset("""
    not no never than least most over under above below about approximately approx around roughly nearly almost
    between and or to up from except divided squared cubed root sqrt half halves quarter quarters score scores gross
    ten tens grand lakh lakhs crore crores fold double doubled triple tripled halved twice thrice reciprocal inverse
    opposite pi log ln exp sin cos tan cot sec csc inf infinity infty factorial power mod modulo
""".split())
_ORDINAL = re.compile(r"(?:third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
                      r"(?:thir|four|fif|six|seven|eigh|nine)teenth|(?:twen|thir|for|fif|six|seven|eigh|nine)tieth|"
                      r"hundredth|thousandth|millionth|billionth|trillionth)s?")
# One name per unit, so that `5 ft` is `5 feet` and `6 hrs` is `6 hours`.
_UNIT_NAMES = {
    **dict.fromkeys(("ft", "feet", "foot"), "foot"), **dict.fromkeys(("in", "inch"), "inch"),
    **dict.fromkeys(("yd", "yard"), "yard"), **dict.fromkeys(("mi", "mile"), "mile"),
    **dict.fromkeys(("mm", "millimeter", "millimetre"), "mm"),
    **dict.fromkeys(("cm", "centimeter", "centimetre"), "cm"),
    **dict.fromkeys(("m", "meter", "metre"), "m"), **dict.fromkeys(("km", "kilometer", "kilometre"), "km"),
    **dict.fromkeys(("g", "gram"), "g"), **dict.fromkeys(("kg", "kilogram"), "kg"),
    **dict.fromkeys(("lb", "pound"), "pound"), **dict.fromkeys(("oz", "ounce"), "ounce"),
    **dict.fromkeys(("l", "liter", "litre"), "liter"), **dict.fromkeys(("ml", "milliliter", "millilitre"), "ml"),
    **dict.fromkeys(("s", "sec", "second"), "second"), **dict.fromkeys(("min", "minute"), "minute"),
    **dict.fromkeys(("h", "hr", "hour"), "hour"), **dict.fromkeys(("mph", "mile per hour"), "mile per hour"),
    **dict.fromkeys(("sq ft", "square foot", "square feet"), "square foot"), **dict.fromkeys(("cent", "¢"), "cent"),
}


@dataclass(frozen=True, slots=True)
class _Answer:
    text: str
    value: Fraction | None = None
    integer: str | None = None  # sign and digits without leading zeros: no int() limit on its length
    words: str | None = None
    wrapped: bool = False
    choice: str | None = None  # the letter a multiple-choice answer picks
    quantity: Fraction | None = None
    amount: Fraction | None = None  # the number of a number with words, whatever the words
    unit: str = ""  # the words after that number (or its currency), singular, lower case
    rescaled: bool = False  # one number whose words change its value: equal to no plain number


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
    repeating = _REPEATING.fullmatch(text)
    if repeating:
        sign, whole, fixed, period = repeating.groups()
        value = Fraction(int(whole + fixed + period) - int(whole + fixed or "0"),
                         10 ** len(fixed) * (10 ** len(period) - 1)) * (-1 if sign else 1)
        return _Answer(text, value=value, quantity=value)
    number = _NUMBER.fullmatch(text)
    if number:
        value = _fraction(number)
        digits = number.group(2).lstrip("0") if number.group(2) else None
        integer = None if digits is None else f"{number.group(1)}{digits}" if digits else "0"
        return _Answer(text, value=value, integer=integer, quantity=value)
    plain = _unwrapped(tidied)
    choice = _CHOICE.fullmatch(plain)
    letter = (choice.group(1) or choice.group(2)).upper() if choice else None
    words = plain.strip(_PUNCTUATION)
    if _WORDS.fullmatch(words) and _TWO_LETTERS.search(words):
        return _Answer(text, words=" ".join(words.lower().split()), wrapped=plain != tidied, choice=letter)
    quantity = _QUANTITY.fullmatch(plain)
    if quantity:
        lead, currency, amount, unit = quantity.groups()
        try:
            value = Fraction(amount)
        except ValueError:
            return _Answer(text, choice=letter)
        lead_words, unit_words = (lead or "").lower().split(), [_singular(w) for w in unit.lower().split()]
        if lead_words and lead_words[-1] in _NEGATIONS:
            value, lead_words = -value, lead_words[:-1]
        if unit_words and unit_words[0] in _SCALES:
            value, unit_words = value * _SCALES[unit_words[0]], unit_words[1:]
        if (not _FILLER.issuperset(lead_words) or not _VALUE_WORDS.isdisjoint(unit_words)
                or any(_ORDINAL.fullmatch(word) for word in unit_words)):
            return _Answer(text, choice=letter, rescaled=True)
        words = " ".join(unit_words)
        unit = _UNIT_NAMES.get(words, words) or _CURRENCY.get((currency or "").strip(), "")
        # `2 x` may be a variable, `3 m` a unit: not a quantity, but a unit another one can contradict
        quantity = value if all(len(word) > 1 for word in unit_words) else None
        return _Answer(text, choice=letter, quantity=quantity, amount=value, unit=unit)
    return _Answer(text, choice=letter)


def _unwrapped(tidied: str) -> str:
    """The answer with its text-style wrappers opened (`\\textbf{\\text{Yes.}}` → `Yes.`), spaces collapsed."""
    while True:
        opened = _WRAPPER.sub(lambda m: f" {m.group(1)} ", tidied)
        if opened == tidied:
            return " ".join(tidied.split())
        tidied = opened


def _singular(word: str) -> str:
    if word.endswith(("ches", "shes", "sses", "xes")):
        return word[:-2]
    return word[:-1] if word.endswith("s") and not word.endswith("ss") else word


def _choice_label(text: str) -> str | None:
    """The letter of a multiple-choice label (`B`, `(B)`, `\\text{(B)}`), None for any other label."""
    label = _CHOICE_LABEL.fullmatch(_unwrapped(text))
    return label.group(1) if label else None


_build_cached = lru_cache(maxsize=16384)(_build)


def _answer(raw: str) -> _Answer:
    return _build_cached(raw) if len(raw) <= _CACHED_LENGTH else _build(raw)


@lru_cache(maxsize=4096)
def _reference(label: str) -> _Answer:
    answer = _build(reference_answer(label))
    return replace(answer, choice=_choice_label(answer.text))


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
    if gold.choice is not None and pred.choice is not None:
        return pred.choice == gold.choice
    if pred.wrapped or gold.wrapped:
        return pred.words is not None and pred.words == gold.words
    if pred.amount is not None and pred.amount == gold.amount and pred.unit and gold.unit:
        return pred.unit == gold.unit
    if pred.quantity is not None and gold.quantity is not None and (pred.amount is not None or
                                                                    gold.amount is not None):
        return pred.quantity == gold.quantity  # a number with words: its value decides, whatever math-verify reads
    if pred.quantity is not None and pred.quantity == gold.quantity:
        return True
    if (pred.rescaled and gold.quantity is not None) or (gold.rescaled and pred.quantity is not None):
        return False
    if len(pred.text) > _CACHED_LENGTH:
        return _math_verify_equal(gold.text, pred.text)
    return _math_verify_equal_cached(gold.text, pred.text)
