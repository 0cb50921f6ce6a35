"""Minerva's answer normalisation (Lewkowycz et al., 2022), exactly as DAPO's accuracy reward applies it.

DAPO's recipes (DAPO's own check, verl's math_dapo, MindSpeed-RL's `acc_for_dapo`) are trained against
this string comparison: a prediction scores only when its normalised spelling is the label's. It is kept
apart from mindrl's mathematical equality (equality.py) on purpose: another notion of "equal" changes
the reward, and with it what a reproduced run learns (`0.5` is not `\\frac{1}{2}` here, `1,000` is
`1000`). Its quirks are part of the check and are kept: every `a ` and `an ` goes, inside words too
(`a banana split` is `banansplit`), the unit words go wherever they stand (`always` is `al`, `\\sigma` is
`\\sia`), only the first `$…$` of a line survives, and a trailing period stays (`5.` is not `5`).
"""

from __future__ import annotations

import re

# The two tables below are Minerva's, in its order: each rewrite sees the result of the ones before.
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
# (pattern, replacement), applied in order with re.sub: what is inside the first `$…$` of each line,
# then the argument of each wrapper (the first `}` closes \text{}; the last one closes \boxed{}),
# then TeX's one-character arguments braced (`\frac12` is `\frac{1}{2}`, `\sqrt2` is `\sqrt{2}`).
_REWRITES = tuple((re.compile(pattern), replacement) for pattern, replacement in (
    (r".*?\$(.*?)\$.*", r"$\1$"),
    (r"\\text\{(.*?)\}", r"\1"),
    (r"\\textbf\{(.*?)\}", r"\1"),
    (r"\\overline\{(.*?)\}", r"\1"),
    (r"\\boxed\{(.*)\}", r"\1"),
    (r"frac([^{])(.)", r"frac{\1}{\2}"),
    (r"sqrt([^{])", r"sqrt{\1}"),
))


def normalise_final_answer(answer: str) -> str:
    """Minerva's `normalize_final_answer`: the spelling two answers must share to count as equal."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expression in _REMOVED:
        answer = answer.replace(expression, "")
    for pattern, replacement in _REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()
