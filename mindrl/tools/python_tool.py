"""The `python` tool: the model's code run in the sandbox (mindrl/tools/sandbox.py) under its entry's limits."""

from __future__ import annotations

import dataclasses

from mindrl.config.errors import ConfigError
from mindrl.tools.sandbox import Limits, bwrap_binary, run_python
from mindrl.tools.tool import Tool, ToolFailure, function_schema

SCHEMA = function_schema(
    "python", "Run a Python 3 program (standard library only, no network, a fresh directory) and see what it "
              "prints. Only printed output comes back: print the values you need.",
    {"code": {"type": "string", "description": "the program"}}, ["code"])


def build(settings: dict, where: str) -> Tool:
    limits, bwrap = _limits(settings, where), bwrap_binary()

    def python(code: str) -> str:
        outcome = run_python(code, limits, bwrap)
        if outcome.status != "ok":
            raise ToolFailure(outcome.status, outcome.text)
        return outcome.text

    return Tool(SCHEMA, python, limits.footprint_bytes)


def _limits(settings: dict, where: str) -> Limits:
    fields = {field.name: field.type for field in dataclasses.fields(Limits)}
    for key, value in settings.items():
        if key not in fields:
            raise ConfigError(f"{where}: the python tool has no setting {key!r}; its settings: {', '.join(fields)}.")
        number = (int, float) if fields[key] == "float" else int
        if isinstance(value, bool) or not isinstance(value, number) or value <= 0:
            raise ConfigError(f"{where}: the python tool's {key} is {value!r}; it must be a positive "
                              f"{'number' if fields[key] == 'float' else 'integer'}.")
    return Limits(**settings)
