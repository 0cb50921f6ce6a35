"""The rollout's side of tool use: a turn's parsed calls in, the model's answers out, never an exception.

Built once per rollout process; a turn's calls run concurrently on threads (a python call is a subprocess, so the
threads only wait).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mindrl.config.errors import ConfigError
from mindrl.tools.config import default_tools, read_tool_config
from mindrl.tools.tool import Tool, ToolFailure, bad_arguments


@dataclass(frozen=True)
class ToolCall:
    """What the parser found in one <tool_call> block."""

    name: str | None  # None when the block was malformed
    arguments: dict
    error: str | None = None  # set by the parser for a malformed block: the text the model gets back


@dataclass(frozen=True)
class ToolResult:
    text: str  # what goes back to the model, already cut to max_tool_response_length
    status: str  # "ok", "error" (bad call, or the tool raised), "timeout" (wall clock or CPU), "killed" (a limit)
    seconds: float


class ToolBox:
    def __init__(self, tools: list[Tool], max_parallel_calls: int, max_tool_response_length: int,
                 truncate_side: str) -> None:
        self._tools = {tool.name: tool for tool in tools}
        self._limit, self._side, self._parallel = max_tool_response_length, truncate_side, max_parallel_calls
        self._pool = ThreadPoolExecutor(max_parallel_calls, thread_name_prefix="tool-call")

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """One result per call, in the calls' order."""
        return list(self._pool.map(self._run_one, calls))

    def schemas(self) -> list[dict]:
        """The tools' OpenAI function schemas, for the system prompt."""
        return [tool.schema for tool in self._tools.values()]

    @property
    def footprint_bytes(self) -> int:
        """The most memory a turn's calls may hold at once outside this process."""
        return self._parallel * max(tool.footprint_bytes for tool in self._tools.values())

    def close(self) -> None:
        self._pool.shutdown()

    def __enter__(self) -> ToolBox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run_one(self, call: ToolCall) -> ToolResult:
        start = time.monotonic()
        text, status = self._answer(call)
        return ToolResult(truncate(text, self._limit, self._side), status, time.monotonic() - start)

    def _answer(self, call: ToolCall) -> tuple[str, str]:
        if call.error is not None or call.name is None:
            return call.error or "malformed tool call", "error"
        tool = self._tools.get(call.name)
        if tool is None:
            return f"unknown tool {call.name!r}; tools: {', '.join(self._tools)}", "error"
        if problem := bad_arguments(tool.schema, call.arguments):
            return problem, "error"
        try:
            return str(tool.fn(**call.arguments)), "ok"
        except ToolFailure as failure:
            return failure.text, failure.status
        except Exception as err:  # a tool's own failure is the model's answer, not the rollout's end
            return f"{call.name} failed: {type(err).__name__}: {err}", "error"


def load_toolbox(tool_config_path: str | None, max_parallel_calls: int, max_tool_response_length: int,
                 truncate_side: str) -> ToolBox:
    """The tools of `tool_config_path` (docs/tools.md), or the built-in python and calculator tools if None."""
    if isinstance(max_parallel_calls, bool) or not isinstance(max_parallel_calls, int) or max_parallel_calls < 1:
        raise ConfigError(f"max_parallel_calls is {max_parallel_calls!r}; it must be an integer of at least 1.")
    tools = default_tools() if tool_config_path is None else read_tool_config(tool_config_path)
    return ToolBox(tools, max_parallel_calls, max_tool_response_length, truncate_side)


def truncate(text: str, limit: int, side: str) -> str:
    """MindSpeed-RL's (and verl's) cut of a tool response to `limit` characters: "left" keeps the head, "right"
    the tail, anything else half of each; a marker stands where text was cut, and limit <= 0 cuts nothing."""
    if limit <= 0 or len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    head = limit - limit // 2
    return text[:head] + "...(truncated)..." + text[len(text) - limit // 2:]
