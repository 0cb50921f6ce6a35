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

import inspect
import math

from mindrl.config.errors import ConfigError
from mindrl.config.imports import is_spec, load_callable
from mindrl.rewards.registration import REGISTRY, Verifier


def known_verifiers() -> list[str]:
    _load_builtins()
    return sorted(REGISTRY)


def get_verifier(name: str) -> Verifier:
    """The verifier for a registered name or a `file.py:function` / `module:function` spec."""
    _load_builtins()
    if name in REGISTRY:
        return REGISTRY[name]
    if is_spec(name):
        fn = load_callable(name, "custom verifier")
        _check_signature(name, name.rpartition(":")[2], fn)
        REGISTRY[name] = fn
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


def _check_signature(spec: str, name: str, fn: Verifier) -> None:
    """A verifier is called as fn(response, label), or fn(response, label, tool_calls=k) when it declares
    `tool_calls`, in every scoring process: a function that cannot take that call would fail on every sample,
    each failure scored as the worst score, and the run would train on noise."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a C function may not describe itself: nothing to compare with
        return
    counted = takes_tool_calls(fn)
    try:
        signature.bind("response", "label", **({"tool_calls": 0} if counted else {}))
    except TypeError:
        call = f"{name}(response, label{', tool_calls=0' if counted else ''})"
        raise ConfigError(f"custom verifier {spec!r}: {name}{signature} cannot be called as {call}; a verifier takes "
                          f"the response text and the label (two positional parameters), optionally a parameter "
                          f"named tool_calls (the sample's number of tool calls), and returns a float.") from None


def takes_tool_calls(fn: Verifier) -> bool:
    """Whether `fn` declares a parameter named `tool_calls` that can be passed by name: only such a verifier is
    given the sample's tool-call count, so every other one is called exactly as before. Asked once per verifier."""
    try:
        parameter = inspect.signature(fn).parameters.get("tool_calls")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


def _load_builtins() -> None:
    from mindrl.rewards import verifiers  # noqa: F401  (registers on import)
