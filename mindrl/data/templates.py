"""Prompt templates: configs/model/templates.json (MindSpeed-RL's schema) or the tokenizer's own.

A template renders one user turn into the prompt text the policy continues:
prefix + system block (the sample's system text, else the template's default, omitted
when both are empty) + user block. Slots are literal strings with `{{content}}`, or
one-element lists naming a special token of the tokenizer (`["bos_token"]`). The name
`tokenizer` uses the tokenizer's chat template (`apply_chat_template`) instead.

A multi-turn rollout also needs the template's tool turn (`format_observation`, MindSpeed-RL's key) and
what the template writes after the assistant's end of turn (`format_assistant`'s text after its stop
word, "\n" in ChatML): a loop that leaves that newline out trains on sequences the chat format never
produces, and the gap grows by one token a turn (verl PR 6921).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindrl.config.errors import ConfigError
from mindrl.config.paths import MODEL_CONFIGS_DIR

DEFAULT_TEMPLATES = MODEL_CONFIGS_DIR / "templates.json"
TOKENIZER_TEMPLATE = "tokenizer"


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

    def render(self, prompt: str, system: str | None = None, tokenizer: Any = None) -> str:
        text = _slots(self.prefix, "", tokenizer)
        system_text = system if system else self.default_system
        if system_text and self.system:
            text += _slots(self.system, system_text, tokenizer)
        return text + _slots(self.user, prompt, tokenizer)

    def tool_turn(self, tokenizer: Any = None) -> tuple[str, str, str]:
        """(after the model's end of turn, the tool turn before its content, after it), as text."""
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
        return after, opening, closing


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
        )
    return templates


class ChatTemplate:
    """The tokenizer's own chat template, with a generation prompt appended."""

    name = TOKENIZER_TEMPLATE
    #: the tokenizer's chat template names no end of turn apart from its eos
    stop_words: tuple[str, ...] = ()

    def tool_turn(self, tokenizer: Any = None) -> tuple[str, str, str]:
        raise ConfigError("prompt_type: tokenizer names no tool turn mindrl can add token by token; preprocess the "
                          "data with a template that has format_observation (qwen, chatml, qwen_r1).")

    def render(self, prompt: str, system: str | None = None, tokenizer: Any = None) -> str:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ConfigError("prompt_type: tokenizer needs a tokenizer that has a chat_template.")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def get_template(name: str, path: str | Path | None = None) -> Template | ChatTemplate:
    """The template `name` from `path` (default configs/model/templates.json), or the tokenizer's."""
    if name == TOKENIZER_TEMPLATE:
        return ChatTemplate()
    templates = load_templates(path)
    if name not in templates:
        raise ConfigError(f"unknown prompt_type {name!r}; known: {', '.join(sorted(templates))}, "
                          f"{TOKENIZER_TEMPLATE} (add your own to templates.json or set prompt_type_path).")
    return templates[name]
