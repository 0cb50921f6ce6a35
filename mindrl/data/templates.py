"""Prompt templates: configs/model/templates.json (MindSpeed-RL's schema) or the tokenizer's own.

A template renders one user turn into the prompt text the policy continues:
prefix + system block (the sample's system text, else the template's default, omitted
when both are empty) + user block. Slots are literal strings with `{{content}}`, or
one-element lists naming a special token of the tokenizer (`["bos_token"]`). The name
`tokenizer` uses the tokenizer's chat template (`apply_chat_template`) instead.

A multi-turn rollout also needs the template's tool turn (`format_observation`, MindSpeed-RL's key), what
goes between two results of one turn (`format_observation_separator`: Qwen's chat template gives each result
its own `<tool_response>` block in one user turn), and what the template writes after the assistant's end of
turn (`format_assistant`'s text after its stop word, "\n" in ChatML): a loop that leaves that newline out
trains on sequences the chat format never produces, and the gap grows by one token a turn (verl PR 6921).
Its tools are announced in the system text (`format_tools`, MindSpeed-RL's key: `{"tool_format": "qwen"}`
appends Qwen's `# Tools` block), so a model is told the names and arguments the rollout's tools take.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindrl.config.errors import ConfigError
from mindrl.config.paths import MODEL_CONFIGS_DIR

DEFAULT_TEMPLATES = MODEL_CONFIGS_DIR / "templates.json"
TOKENIZER_TEMPLATE = "tokenizer"
#: Qwen2.5's tools block, as its chat template appends it to the system text: each tool's schema as one JSON line
_QWEN_TOOLS_HEAD = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
                    "provided with function signatures within <tools></tools> XML tags:\n<tools>")
_QWEN_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                    "\"arguments\": <args-json-object>}\n</tool_call>")
TOOL_FORMATS = ("qwen",)
_TOOLS_BLOCK = re.compile(re.escape(_QWEN_TOOLS_HEAD.lstrip("\n")) + r"(.*?)" + re.escape("\n</tools>"), re.DOTALL)


@dataclass(frozen=True)
class ToolTurn:
    """A tool turn as text: after the model's end of turn, the turn up to its first result, between two results
    (None: the template cannot hold two), and after the last result up to the model's next turn."""

    after: str
    opening: str
    separator: str | None
    closing: str


@dataclass(frozen=True)
class Template:
    name: str
    user: tuple[Any, ...]
    system: tuple[Any, ...] = ()
    prefix: tuple[Any, ...] = ()
    default_system: str = ""
    stop_words: tuple[str, ...] = ()
    #: format_observation: a tool turn, from the end of the model's turn to the start of its next one
    observation: tuple[Any, ...] = ()
    #: format_assistant: the model's turn as the template writes it
    assistant: tuple[Any, ...] = ()
    #: format_observation_separator: between two results of one tool turn
    observation_separator: tuple[Any, ...] = ()
    #: format_tools' tool_format: how the tools' schemas are appended to the system text (None: not at all)
    tool_format: str | None = None

    def render(self, prompt: str, system: str | None = None, tokenizer: Any = None,
               tools: Sequence[dict] = ()) -> str:
        """The prompt text; `tools` (OpenAI function schemas) are announced in the system text."""
        text = _slots(self.prefix, "", tokenizer)
        system_text = system if system else self.default_system
        if tools:
            if self.tool_format is None or not self.system:
                raise ConfigError(f"template {self.name!r} has no {'format_tools' if self.system else 'system turn'} "
                                  f"to announce tools in; use a template with format_tools (qwen, chatml, qwen_r1) "
                                  f"or drop tool_config_path from the preprocessing recipe.")
            # Qwen's block follows the system text; with none to follow it starts the turn
            system_text = (system_text + tools_block(tools, self.tool_format)) if system_text else \
                tools_block(tools, self.tool_format).lstrip("\n")
        if system_text and self.system:
            text += _slots(self.system, system_text, tokenizer)
        return text + _slots(self.user, prompt, tokenizer)

    def tool_turn(self, tokenizer: Any = None) -> ToolTurn:
        """The tool turn's pieces as text."""
        if not self.observation:
            raise ConfigError(f"template {self.name!r} has no tool turn (format_observation), so a multi-turn "
                              f"rollout cannot hand tool results back; use a template with one (qwen, chatml, "
                              f"qwen_r1) or add format_observation to it.")
        opening, marker, closing = _slots(self.observation, "\0", tokenizer).partition("\0")
        if not marker:
            raise ConfigError(f"template {self.name!r}'s format_observation has no {{{{content}}}} slot for the tool "
                              f"result.")
        after = _slots(self.assistant, "\0", tokenizer).partition("\0")[2] if self.assistant else ""
        for word in self.stop_words:
            if after.startswith(word):
                after = after[len(word):]
                break
        separator = _slots(self.observation_separator, "", tokenizer) if self.observation_separator else None
        return ToolTurn(after, opening, separator, closing)


def _slots(slots: tuple[Any, ...], content: str, tokenizer: Any) -> str:
    out = []
    for slot in slots:
        if isinstance(slot, str):
            out.append(slot.replace("{{content}}", content))
        elif isinstance(slot, list | tuple) and len(slot) == 1:
            token = getattr(tokenizer, slot[0], None) if tokenizer is not None else None
            if token is None:
                raise ConfigError(f"template slot {slot} needs the tokenizer's {slot[0]}, which it does not have.")
            out.append(token)
        elif isinstance(slot, dict) and "token" in slot:
            out.append(slot["token"])
        else:
            raise ConfigError(f"template slot {slot!r} is neither text nor a special-token name.")
    return "".join(out)


def load_templates(path: str | Path | None = None) -> dict[str, Template]:
    """Templates by name from a templates.json (a JSON array of template objects)."""
    path = Path(path or DEFAULT_TEMPLATES)
    if not path.is_file():
        raise ConfigError(f"prompt_type_path {path} does not exist.")
    templates = {}
    for entry in json.loads(path.read_text()):
        if "name" not in entry or "format_user" not in entry:
            raise ConfigError(f"{path}: every template needs a name and a format_user, got {sorted(entry)}.")
        templates[entry["name"]] = Template(
            name=entry["name"],
            user=tuple(entry["format_user"]["slots"]),
            system=tuple(entry.get("format_system", {}).get("slots", ())),
            prefix=tuple(entry.get("format_prefix", {}).get("slots", ())),
            default_system="".join(entry["default_system"]) if isinstance(entry.get("default_system"), list)
            else entry.get("default_system", ""),
            stop_words=tuple(entry.get("stop_words", ())),
            observation=tuple(entry.get("format_observation", {}).get("slots", ())),
            assistant=tuple(entry.get("format_assistant", {}).get("slots", ())),
            observation_separator=tuple(entry.get("format_observation_separator", {}).get("slots", ())),
            tool_format=entry.get("format_tools", {}).get("tool_format"),
        )
    return templates


def tools_block(tools: Sequence[dict], tool_format: str) -> str:
    """The system text's announcement of `tools`, as the template's tool format writes it: for `qwen`, Qwen2.5's
    chat template's block (each schema `tojson`-ed as transformers' chat templates do: json.dumps, unsorted keys,
    non-ASCII kept)."""
    if tool_format not in TOOL_FORMATS:
        raise ConfigError(f"format_tools' tool_format {tool_format!r} is not one mindrl writes; known: "
                          f"{', '.join(TOOL_FORMATS)}.")
    return _QWEN_TOOLS_HEAD + "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools) + \
        _QWEN_TOOLS_TAIL


def announced_tools(text: str) -> list[dict] | None:
    """The tool schemas a prompt's text announces in Qwen's tools block (written here or by Qwen's own chat
    template), None where it announces none."""
    found = _TOOLS_BLOCK.search(text)
    if found is None:
        return None
    tools = []
    for line in found.group(1).splitlines():
        if line.strip():
            try:
                tools.append(json.loads(line))
            except json.JSONDecodeError:
                raise ConfigError(f"a prompt's tools block holds a line that is not JSON ({line[:80]!r}); "
                                  f"preprocess the data again.") from None
    return tools


class ChatTemplate:
    """The tokenizer's own chat template, with a generation prompt appended."""

    name = TOKENIZER_TEMPLATE
    #: the tokenizer's chat template names no end of turn apart from its eos
    stop_words: tuple[str, ...] = ()

    def tool_turn(self, tokenizer: Any = None) -> ToolTurn:
        raise ConfigError("prompt_type: tokenizer names no tool turn mindrl can add token by token; preprocess the "
                          "data with a template that has format_observation (qwen, chatml, qwen_r1).")

    def render(self, prompt: str, system: str | None = None, tokenizer: Any = None,
               tools: Sequence[dict] = ()) -> str:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ConfigError("prompt_type: tokenizer needs a tokenizer that has a chat_template.")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, tools=list(tools) or None, tokenize=False,
                                             add_generation_prompt=True)


def get_template(name: str, path: str | Path | None = None) -> Template | ChatTemplate:
    """The template `name` from `path` (default configs/model/templates.json), or the tokenizer's."""
    if name == TOKENIZER_TEMPLATE:
        return ChatTemplate()
    templates = load_templates(path)
    if name not in templates:
        raise ConfigError(f"unknown prompt_type {name!r}; known: {', '.join(sorted(templates))}, "
                          f"{TOKENIZER_TEMPLATE} (add your own to templates.json or set prompt_type_path).")
    return templates[name]
