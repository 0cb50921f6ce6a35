"""The tool config file (`tool_config_path`): which tools a rollout offers, their settings and their schemas.

verl's shape, `tools: [{class_name, config, tool_schema}]`, with `name` in class_name's place: a built-in's name or
a custom tool's `path/to/file.py:function`. Unknown keys are refused rather than ignored, so a misspelt limit
cannot leave a default in force unnoticed.

MindSpeed-RL's own tool files load as published: its ReTool class is mindrl's python tool, with its time and
memory limits carried over. The rest of its settings configure the SandboxFusion service that ReTool sends code
to (its address, its worker count and rate limit); mindrl runs each call in a local bubblewrap sandbox
instead, so they have nothing to configure and are accepted as read (docs/tools.md).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mindrl.config.errors import ConfigError
from mindrl.tools.registry import BUILTINS, build_tool
from mindrl.tools.tool import Tool, function_schema

_ENTRY_KEYS = ("name", "config", "tool_schema")
#: MindSpeed-RL's ReTool class and its settings: those that map onto the python tool's limits, and its service's
_RETOOL = "mindspeed_rl.tools.retool.ReTool"
_RETOOL_LIMITS = {"default_timeout": ("timeout_s", "cpu_seconds"), "memory_limit_mb": ("memory_mb",)}
_RETOOL_SERVICE = ("sandbox_fusion_url", "num_workers", "enable_global_rate_limit", "rate_limit", "type",
                   "default_language")


def read_tool_config(path: str) -> list[Tool]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"tool_config_path {file} does not exist.")
    try:  # OmegaConf, so `1e2` is a number as in the run's Hydra config
        data = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
    except (yaml.YAMLError, OmegaConfBaseException) as err:
        raise ConfigError(f"tool_config_path {file} is not valid YAML ({' '.join(str(err).split())}).") from None
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list) or not data["tools"]:
        raise ConfigError(f"{file} must hold `tools:`, a list of tools, each with a name ({', '.join(BUILTINS)} or "
                          f"path/to/file.py:function).")
    if extra := [key for key in data if key != "tools"]:
        raise ConfigError(f"{file}: unknown key {extra[0]!r}; a tool config holds only `tools:`.")
    tools = [_entry(entry, f"{file}, tool {number}") for number, entry in enumerate(data["tools"], 1)]
    names = [tool.name for tool in tools]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise ConfigError(f"{file}: two tools are named {twice[0]!r}; the model could not tell them apart.")
    return tools


def default_tools() -> list[Tool]:
    """The built-ins with their default settings, for a rollout given no tool config."""
    return [build_tool(name, {}, None, "the default tools") for name in BUILTINS]


def _entry(entry: object, where: str) -> Tool:
    if isinstance(entry, dict) and entry.get("class_name") == _RETOOL:
        entry = _from_retool(entry, where)
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        verl = isinstance(entry, dict) and "class_name" in entry
        raise ConfigError(f"{where} needs a name: {', '.join(BUILTINS)} or path/to/file.py:function"
                          f"{' (in place of verl class_name)' if verl else ''}.")
    if unknown := [key for key in entry if key not in _ENTRY_KEYS]:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; an entry has {', '.join(_ENTRY_KEYS)}.")
    settings = entry.get("config") or {}
    if not isinstance(settings, dict):
        raise ConfigError(f"{where}: config must map setting names to values.")
    schema = None if entry.get("tool_schema") is None else _schema(entry["tool_schema"], where)
    return build_tool(entry["name"], settings, schema, where)


def _from_retool(entry: dict, where: str) -> dict:
    """MindSpeed-RL's ReTool entry as a python-tool entry: its limits kept, its service's settings dropped."""
    settings = dict(entry.get("config") or {})
    if str(settings.get("default_language", "python")).lower() != "python":
        raise ConfigError(f"{where}: ReTool's default_language is {settings['default_language']!r}, but mindrl's "
                          f"sandbox runs Python only; set it to python.")
    if unknown := [key for key in settings if key not in _RETOOL_LIMITS and key not in _RETOOL_SERVICE]:
        raise ConfigError(f"{where}: ReTool has no setting {unknown[0]!r}; its settings: "
                          f"{', '.join((*_RETOOL_LIMITS, *_RETOOL_SERVICE))}.")
    limits = {limit: settings[key] for key, names in _RETOOL_LIMITS.items() if key in settings for limit in names}
    return {"name": "python", "config": limits,
            **{key: value for key, value in entry.items() if key not in ("class_name", "config")}}


def _schema(raw: object, where: str) -> dict:
    """An OpenAI function schema, given whole (`{type: function, function: {...}}`) or as its function part."""
    function = raw.get("function", raw) if isinstance(raw, dict) else None
    parameters = function.get("parameters", {}) if isinstance(function, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"] or \
            not isinstance(parameters, dict) or not isinstance(parameters.get("properties", {}), dict):
        raise ConfigError(f"{where}: tool_schema must be an OpenAI function schema with a name and its parameters' "
                          f"properties.")
    properties, required = parameters.get("properties", {}), parameters.get("required", [])
    if not isinstance(required, list):
        raise ConfigError(f"{where}: tool_schema's required must be a list of property names.")
    if missing := [key for key in required if key not in properties]:
        raise ConfigError(f"{where}: tool_schema requires {missing[0]!r}, which is not among its properties.")
    return function_schema(function["name"], function.get("description", ""), properties, required)
