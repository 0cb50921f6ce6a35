"""One spelling per answer, so that equal answers written differently compare as strings.

Every rewrite here keeps the meaning: unicode look-alikes become the ASCII or LaTeX they
stand for (a policy copying `−3` from a web page means -3, not 3; `٥` is 5), LaTeX spacing
commands go, `$` delimiters go, thousands separators go (commas only outside brackets and
set braces, where `(2,500)` is a pair; spaces only in an answer that is one number,
`1\\,000`), a group doubled inside itself (`{{5}}`, `((5))`) is written once, and whitespace
stays only where it separates two letters or digits (`\\pi r`, `2 3`) or follows a comma
(`5, 125`, a list). LaTeX's row separator `\\\\` is read as one token before any spacing
command, so `1 \\\\ 2` keeps its rows. Nothing is deleted that could carry a value:
`\\text{...}` keeps its content, units are left to the equality steps.
"""

from __future__ import annotations

import re
import unicodedata

_MINUS = "-"
_CHARACTERS = {
    "\u2212": _MINUS, "\u2010": _MINUS, "\u2011": _MINUS, "\u2012": _MINUS, "\u2013": _MINUS,
    "\ufe63": _MINUS, "\uff0d": _MINUS, "\u2796": _MINUS, "\u2795": "+",
    "\u00d7": "\\times ", "\u2715": "\\times ", "\u00f7": "\\div ",
    "\u00b7": "\\cdot ", "\u22c5": "\\cdot ", "\u2219": "\\cdot ",
    "\u221e": "\\infty ", "\u03c0": "\\pi ", "\u2264": "\\le ", "\u2265": "\\ge ", "\u2260": "\\ne ",
    "\u00bd": "\\frac{1}{2}", "\u2153": "\\frac{1}{3}", "\u2154": "\\frac{2}{3}", "\u00bc": "\\frac{1}{4}",
    "\u00be": "\\frac{3}{4}", "\u2155": "\\frac{1}{5}", "\u2156": "\\frac{2}{5}", "\u2157": "\\frac{3}{5}",
    "\u2158": "\\frac{4}{5}", "\u2159": "\\frac{1}{6}", "\u215a": "\\frac{5}{6}", "\u2150": "\\frac{1}{7}",
    "\u215b": "\\frac{1}{8}", "\u215c": "\\frac{3}{8}", "\u215d": "\\frac{5}{8}", "\u215e": "\\frac{7}{8}",
    "\u2151": "\\frac{1}{9}", "\u2152": "\\frac{1}{10}",
    "\u00a0": " ", "\u2002": " ", "\u2003": " ", "\u2007": " ", "\u2009": " ", "\u200a": " ", "\u202f": " ",
    "\u3000": " ", "\u200b": "",
}
_CHARACTERS.update({chr(code): chr(code - 0xFEE0) for code in range(0xFF01, 0xFF5F) if chr(code) not in _CHARACTERS})
_TRANSLATION = str.maketrans(_CHARACTERS)
_SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")
_SUPERSCRIPT_RUN = re.compile("[⁰¹²³⁴⁵⁶⁷⁸⁹⁻]+")
_ROOT = re.compile("\u221a(\\d+|[A-Za-z])?")
_OTHER_DIGIT = re.compile(r"(?![0-9])\d")  # a decimal digit of another script

# `\\\\` first, so that the backslash ending a row separator never starts a spacing command.
_LATEX_NOISE = re.compile(r"\\\\|\\[,!;: ]|\\q?quad(?![A-Za-z])|\\(?:left|right)(?![A-Za-z])")
_STYLED_FRACTION = re.compile(r"\\[dt]frac(?![A-Za-z])")
_DOLLAR = re.compile(r"(?<!\\)\$")
# No start right after a digit, point or comma: `1,2,345` is a list, and a start inside a
# long comma chain would rescan the chain (quadratic on repetition loops).
_THOUSANDS = re.compile(r"(?<![\d.,])(\d{1,3}(?:,\d{3})+)(?![\d,])")
# Where a comma separates the items of a pair, interval or set, `2,500` is two numbers.
_LIST_OPENER = re.compile(r"[(\[]|\\\{|\\langle")
_SPACED_THOUSANDS = re.compile(r"-?\d{1,3}(?: \d{3})+(?:\.\d+)?")
_SPACES = re.compile(r"\s+")
_LOOSE_SPACE = re.compile(r"(?<![A-Za-z0-9,]) | (?![A-Za-z0-9])")
# Items keep one space after their comma: `5, 125` is a list, and math-verify reads `5,125` as 5125.
_COMMA = re.compile(r", ?")


def plain_characters(text: str) -> str:
    """Unicode look-alikes as the ASCII / LaTeX they mean (`−3` → `-3`, `x²` → `x^{2}`)."""
    if text.isascii():
        return text
    text = _SUPERSCRIPT_RUN.sub(lambda m: "^{" + m.group(0).translate(_SUPERSCRIPTS) + "}", text)
    text = _ROOT.sub(lambda m: f"\\sqrt{{{m.group(1)}}}" if m.group(1) else "\\sqrt ", text)
    text = _OTHER_DIGIT.sub(lambda m: str(unicodedata.decimal(m.group(0))), text)
    return text.translate(_TRANSLATION)


def _drop_noise(match: re.Match[str]) -> str:
    """A row separator stays; a negative thin space joins (`10,\\!000` is ten thousand); other spacing is a space."""
    token = match.group(0)
    return token if token == "\\\\" else "" if token == "\\!" else " "


def tidy(answer: str) -> str:
    """The answer rewritten (look-alikes, spacing commands, `$`, separators), whitespace collapsed.

    Kept apart from canonical() because reading `so it is -3` as words and a number needs its spaces.
    """
    text = plain_characters(answer)
    text = _LATEX_NOISE.sub(_drop_noise, text)
    text = _STYLED_FRACTION.sub(r"\\frac", text)
    text = _DOLLAR.sub("", text)
    if not _LIST_OPENER.search(text):
        text = _THOUSANDS.sub(lambda m: m.group(1).replace(",", ""), text)
    text = _SPACES.sub(" ", text).strip().rstrip(".").rstrip()
    return text.replace(" ", "") if _SPACED_THOUSANDS.fullmatch(text) else text


def _single_groups(text: str) -> str:
    """`{{x}}` as `{x}` and `((x))` as `(x)`: the same group, and LaTeX parsers take time exponential
    in such nesting (`{` × 16 around a 5 took math-verify over 10 s). Escaped `\\{` is not a group;
    brackets that do not pair up as groups (intervals such as `[0, 1)`) leave the text as it is."""
    if "{{" not in text and "((" not in text:
        return text
    closing, stack = {}, []
    for i, char in enumerate(text):
        if char in "{(" and text[i - 1:i] != "\\":
            stack.append(i)
        elif char in "})" and text[i - 1:i] != "\\" and stack:
            opening = stack.pop()
            if (text[opening] == "{") != (char == "}"):
                return text
            closing[opening] = i
    doubled = {i for opening, end in closing.items()
               if closing.get(opening + 1) == end - 1 and text[opening] == text[opening + 1] for i in (opening, end)}
    return "".join(char for i, char in enumerate(text) if i not in doubled)


def canonical(tidied: str) -> str:
    """A tidied answer in the one spelling string equality compares: no space beside a non-alphanumeric
    but one after each comma, and doubled groups written once."""
    return _single_groups(_COMMA.sub(", ", _LOOSE_SPACE.sub("", tidied)))
