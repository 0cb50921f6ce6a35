"""Type checks for flat config dataclasses, driven by their annotations.

Hydra hands over whatever YAML parsed (`lr: 1e-6` a float, `lr: '1e-6'` a string); a wrong
type must fail here in one sentence, not as a TypeError deep inside a worker.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mindrl.config.errors import ConfigError

_WORDS = {"None": "null", "bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}


def _accepts(part: str, value: Any) -> bool:
    if part == "None":
        return value is None
    if part == "bool":
        return isinstance(value, bool)
    if part == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if part == "float":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if part == "str":
        return isinstance(value, str)
    if part.startswith("list"):
        return isinstance(value, list | tuple)
    return True


def check_types(section: str, obj: Any) -> None:
    """Raise for the first field whose value does not match its annotation; ints become floats.
    `section` names the field in the message (`section.field`); empty where the caller adds it."""
    for f in dataclasses.fields(obj):
        if f.name.startswith("_") or not f.init:
            continue
        value = getattr(obj, f.name)
        parts = [p.strip() for p in str(f.type).split("|")]
        if not any(_accepts(p, value) for p in parts):
            wanted = " or ".join(_WORDS.get(p, "a list" if p.startswith("list") else p) for p in parts)
            raise ConfigError(f"{f'{section}.' if section else ''}{f.name} must be {wanted}, got {value!r}.")
        if "float" in parts and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(obj, f.name, float(value))
        if any(p.startswith("list") for p in parts) and isinstance(value, tuple):
            object.__setattr__(obj, f.name, list(value))


def positive(section: str, obj: Any, *keys: str, allow_zero: bool = False) -> None:
    """Each named int field is ≥ 1 (≥ 0 with allow_zero), unless it is None."""
    floor = 0 if allow_zero else 1
    for key in keys:
        value = getattr(obj, key)
        if value is not None and value < floor:
            raise ConfigError(f"{section}.{key} must be {'>= 0' if allow_zero else 'a positive integer'}, "
                              f"got {value!r}.")
