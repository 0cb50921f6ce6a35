"""A name → function table whose unknown-name error lists the known names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from mindrl.config.errors import ConfigError

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, what: str, config_key: str) -> None:
        self.what, self.config_key = what, config_key
        self._entries: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            for name in names:
                self._entries[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        if name not in self._entries:
            raise ConfigError(f"unknown {self.what} {name!r} for {self.config_key}; known: {', '.join(self.names())}.")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)
