"""A user's own function named in a config, as `path/to/file.py:function` or `package.module:function`.

Custom verifiers and custom tools are named the same way; one loader gives both the same refusals.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

from mindrl.config.errors import ConfigError


def is_spec(name: str) -> bool:
    """Whether `name` names a function by its file or module (a registered name has no colon)."""
    return ":" in name


def load_callable(spec: str, what: str) -> Callable:
    """The function `spec` names; `what` (e.g. "custom verifier") starts each refusal's sentence."""
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"{what} {spec!r}: {path} does not exist.")
        module_spec = importlib.util.spec_from_file_location(f"mindrl_custom_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:  # the user's module: anything it raises while loading is its mistake
            raise ConfigError(f"{what} {spec!r}: {path} fails to load ({type(err).__name__}: {err}).") from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as err:  # ImportError, or whatever the module raises while it loads
            raise ConfigError(f"{what} {spec!r}: cannot import {target!r} ({type(err).__name__}: {err}).") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r}: {target} has no function {attr!r}.")
    return fn
