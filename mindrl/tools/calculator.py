"""The `calculator` tool: arithmetic from a Python `ast` walked by hand.

eval() with empty builtins is no safe evaluator (`().__class__.__base__.__subclasses__()` reaches everything), so
only number constants, + - * / // % **, unary signs and parentheses are evaluated and anything else is refused.
Integer results are capped in size: one `**` can ask for more digits than memory holds (2**10**10), so a power is
refused before it is computed if its result would pass the cap.
"""

from __future__ import annotations

import ast
import operator

from mindrl.config.errors import ConfigError
from mindrl.tools.tool import Tool, ToolFailure, function_schema

#: Python refuses to print an integer of more than 4300 digits; 4000 digits is about this many bits
MAX_BITS = 13_288

SCHEMA = function_schema(
    "calculator", "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses.",
    {"expression": {"type": "string", "description": "the expression, e.g. (3 + 4) ** 2 / 7"}}, ["expression"])

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def build(settings: dict, where: str) -> Tool:
    if settings:
        raise ConfigError(f"{where}: the calculator tool has no setting {next(iter(settings))!r}; it takes none.")
    return Tool(SCHEMA, calculate)


def calculate(expression: str) -> str:
    try:
        return str(_evaluate(ast.parse(expression.strip(), mode="eval").body))
    except SyntaxError:
        why = "it is not an arithmetic expression"
    except ZeroDivisionError:
        why = "it divides by zero"
    except OverflowError:
        why = "the result is too large for a float"
    except RecursionError:
        why = "it is nested too deeply"
    except _Refused as refused:
        why = str(refused)
    raise ToolFailure("error", f"cannot evaluate the expression: {why}.")


class _Refused(Exception):
    pass


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and \
                (left.bit_length() - 1) * right > MAX_BITS:
            raise _Refused(f"the power's result would have more than {MAX_BITS} bits")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):
            raise _Refused("the result is not a real number")
        if isinstance(value, int) and value.bit_length() > MAX_BITS:
            raise _Refused(f"the result has more than {MAX_BITS} bits")
        return value
    raise _Refused(f"{_describe(node)} is not allowed, only numbers, + - * / // % ** and parentheses")


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    return f"a {type(node).__name__} node"
