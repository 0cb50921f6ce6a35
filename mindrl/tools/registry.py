"""The tool registry: a name → a built-in tool's builder, and a user's own function made a tool.

A custom tool is named by `path/to/file.py:function` or `package.module:function` and loaded when the ToolBox is
built. It is trusted code, like a custom verifier: it runs in the rollout process, with no sandbox and no time
limit of ours, so one that calls out to a service must bound its own waits. Its entry's settings are bound to its
keyword parameters; the model's arguments fill the rest.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from mindrl.config.errors import ConfigError
from mindrl.config.imports import is_spec, load_callable
from mindrl.tools import calculator, python_tool
from mindrl.tools.tool import Tool, check_accepts, schema_from_signature

#: name → builder(settings, where) of a built-in tool
BUILTINS: dict[str, Callable[[dict, str], Tool]] = {"python": python_tool.build, "calculator": calculator.build}


def build_tool(name: str, settings: dict, schema: dict | None, where: str) -> Tool:
    """The tool `name` names, with its entry's settings, under `schema` if given (a built-in brings its own: one
    given renames or redescribes it, and must fit its function like a custom tool's)."""
    if name in BUILTINS:
        tool = BUILTINS[name](settings, where)
        if schema is None:
            return tool
        check_accepts(tool.fn, schema, where)
        return Tool(schema, tool.fn, tool.footprint_bytes)
    if not is_spec(name):
        raise ConfigError(f"{where}: unknown tool {name!r}; known: {', '.join(sorted(BUILTINS))} (or your own as "
                          f"path/to/file.py:function or package.module:function).")
    fn = load_callable(name, "custom tool")
    _check_settings(fn, name, settings, schema, where)
    if schema is None:
        schema = schema_from_signature(fn.__name__, fn, set(settings))
    bound = functools.partial(fn, **settings) if settings else fn
    check_accepts(bound, schema, where)
    return Tool(schema, bound)


def _check_settings(fn: Callable, name: str, settings: dict, schema: dict | None, where: str) -> None:
    """A setting must be a parameter of the function and no argument of the model's, which would override it."""
    arguments = schema["function"]["parameters"].get("properties", {}) if schema else {}
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a C function may not describe itself: nothing to compare with
        parameters = None
    for key in settings:
        if key in arguments:
            raise ConfigError(f"{where}: {key!r} is both a setting of tool {name!r} and an argument in its "
                              f"tool_schema; the model's value would override the setting.")
        if parameters is not None and key not in parameters and not any(
                parameter.kind is parameter.VAR_KEYWORD for parameter in parameters.values()):
            raise ConfigError(f"{where}: tool {name!r} has no parameter {key!r} to take that setting.")
