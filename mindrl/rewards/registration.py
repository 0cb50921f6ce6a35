"""The table of built-in verifiers and the decorator that fills it.

Apart from mindrl.rewards.registry (which looks names up and loads custom verifiers) so the
built-ins can register themselves on import without importing the module that imports them.
"""

from __future__ import annotations

from collections.abc import Callable

Verifier = Callable[[str, str], float]
#: name → verifier, filled by @register_verifier and by the custom verifiers loaded so far
REGISTRY: dict[str, Verifier] = {}


def register_verifier(name: str, worst_score: float | None = None) -> Callable[[Verifier], Verifier]:
    """Decorator: make `fn` available to `verifier_function` under `name`, with its worst score."""

    def add(fn: Verifier) -> Verifier:
        if name in REGISTRY and REGISTRY[name] is not fn:
            raise ValueError(f"a verifier named {name!r} is already registered ({REGISTRY[name].__module__}).")
        if worst_score is not None:
            fn.worst_score = float(worst_score)
        REGISTRY[name] = fn
        return fn

    return add
