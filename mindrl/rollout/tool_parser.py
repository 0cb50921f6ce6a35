"""Tool calls in the text of a model turn (`tool_parser_format`).

`hermes` is what Qwen2.5 and Qwen3 chat templates teach: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, several per turn. A block the model got wrong is not an exception: it becomes a call carrying
the sentence its tool response will be, so the model is told what to fix and the run goes on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from mindrl.config import ConfigError
from mindrl.tools import ToolCall

_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """The calls of one turn, in order; a malformed block (no closing tag, not JSON, no name, arguments that are
    not an object) is a ToolCall whose `error` says which."""
    calls = []
    for match in _BLOCK.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(_malformed("the <tool_call> block has no closing </tool_call>"))
            continue
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(_malformed(f"the <tool_call> block is not valid JSON ({err.msg} at character {err.pos})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(_malformed('a tool call is a JSON object with a "name" string and an "arguments" object'))
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments object as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(_malformed(f'the "arguments" of the call to {call["name"]!r} must be a JSON object'))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


def _malformed(why: str) -> ToolCall:
    return ToolCall(None, {}, error=f"error: {why}.")


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": parse_hermes}


def get_parser(name: str) -> Callable[[str], list[ToolCall]]:
    if name not in PARSERS:
        raise ConfigError(f"unknown tool_parser_format {name!r}; known: {', '.join(PARSERS)}.")
    return PARSERS[name]
