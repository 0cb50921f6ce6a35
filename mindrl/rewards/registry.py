"""The verifier registry: a name → a function scoring one response against its label.

A verifier is `fn(response: str, label: str) -> float`. Built-ins register with
@register_verifier; a user's own is named by `path/to/file.py:function` or
`package.module:function` in `verifier_function` and loaded on first use (in every worker
process that scores). An unknown name is an error listing the known ones — MindSpeed-RL
skips it silently, which turns a typo into a run without that reward.

Each verifier declares its worst score (the `worst_score` attribute): a sample that times
out or raises gets it, so that failing is never better than answering. No default can be
safe for a function we have not seen (0.0 beats every negative score), so a custom verifier
without one needs its `verifier_fail_score` entry set.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path

from mindrl.config.errors import ConfigError

Verifier = Callable[[str, str], float]
_REGISTRY: dict[str, Verifier] = {}


def register_verifier(name: str, worst_score: float | None = None) -> Callable[[Verifier], Verifier]:
    """Decorator: make `fn` available to `verifier_function` under `name`, with its worst score."""

    def add(fn: Verifier) -> Verifier:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"a verifier named {name!r} is already registered ({_REGISTRY[name].__module__}).")
        if worst_score is not None:
            fn.worst_score = float(worst_score)
        _REGISTRY[name] = fn
        return fn

    return add


def known_verifiers() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def is_custom(name: str) -> bool:
    return ":" in name


def get_verifier(name: str) -> Verifier:
    """The verifier for a registered name or a `file.py:function` / `module:function` spec."""
    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if is_custom(name):
        fn = _load_custom(name)
        _REGISTRY[name] = fn
        return fn
    raise ConfigError(f"unknown verifier {name!r} in verifier_function; known: {', '.join(known_verifiers())} "
                      f"(or give your own as path/to/file.py:function or package.module:function).")


def fail_score(name: str, configured: float | None) -> float:
    """What a timed-out or failed sample scores: the configured value, else the verifier's worst."""
    if configured is not None:
        return float(configured)
    worst = getattr(get_verifier(name), "worst_score", None)
    if worst is None:
        raise ConfigError(f"verifier {name!r} declares no worst score for timed-out or failed samples; set its entry "
                          f"in verifier_fail_score (e.g. its lowest score) or give the function a worst_score "
                          f"attribute.")
    if isinstance(worst, bool) or not isinstance(worst, int | float) or not math.isfinite(worst):
        raise ConfigError(f"verifier {name!r} has worst_score={worst!r}; it must be a finite number.")
    return float(worst)


def _load_custom(spec: str) -> Verifier:
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"custom verifier {spec!r}: {path} does not exist.")
        module_spec = importlib.util.spec_from_file_location(f"mindrl_custom_verifier_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:  # the user's module: anything it raises while loading is its mistake
            raise ConfigError(f"custom verifier {spec!r}: {path} fails to load ({type(err).__name__}: "
                              f"{err}).") from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as err:  # ImportError, or whatever the module raises while it loads
            raise ConfigError(f"custom verifier {spec!r}: cannot import {target!r} ({type(err).__name__}: "
                              f"{err}).") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"custom verifier {spec!r}: {target} has no function {attr!r}.")
    return fn


def _load_builtins() -> None:
    from mindrl.rewards import verifiers  # noqa: F401  (registers on import)
