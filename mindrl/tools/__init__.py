"""Tools for multi-turn tool-use rollouts: the registry, the python tool's sandbox, and the ToolBox the rollout
calls (docs/tools.md)."""

from mindrl.tools.sandbox import check_sandbox
from mindrl.tools.toolbox import ToolBox, ToolCall, ToolResult, load_toolbox, truncate

__all__ = ["ToolBox", "ToolCall", "ToolResult", "check_sandbox", "load_toolbox", "truncate"]
