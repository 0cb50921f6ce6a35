"""Load Megatron rank files without running code from them.

A rank file written by Megatron-LM or MindSpeed-LLM pickles more than tensors and args:
enums (megatron.core.enums.ModelType, AttnBackend), numpy RNG state, optimizer and
scheduler state, objects of training-only packages that are not installed here. torch's
weights_only loader refuses all of those, and plain pickle would import them and run
whatever their pickles call. This module is a pickle module for torch.load in which only
the globals tensors and args are built from are real (the allowlist below); every other
class or function becomes an `Inert` placeholder that records its arguments and does
nothing, so nothing outside the allowlist is imported or called. The converter then reads
only `model` (and `args`), and refuses a model tensor that came back as a placeholder.
"""

from __future__ import annotations

import argparse
import codecs
import collections
import pickle
import sys
import zipfile
from pathlib import Path
from typing import Any, ClassVar

import torch


def _rebuild_from_type(func: Any, new_type: Any, args: tuple, state: Any) -> Any:
    """A tensor saved with Python attributes or as a subclass: the plain tensor, attributes dropped."""
    return func(*args)


# (module, name) of every global that is really built; tensors, dtypes and args need no more.
_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): argparse.Namespace,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("_codecs", "encode"): codecs.encode,  # how pickle protocol 2 spells bytes
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): torch._utils._rebuild_parameter_with_state,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
}


class Inert:
    """Stands in for an object of a class that was not loaded; holds what its pickle gave it."""

    pickled_as: ClassVar[str] = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Inert:
        obj = super().__new__(cls)
        obj.__dict__.update(args=args, kwargs=kwargs, state=None, items=[])
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: `__new__` kept the arguments."""

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state"] = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__["items"].append((key, value))

    def __call__(self, *args: Any, **kwargs: Any) -> Inert:
        return type(self)(*args, **kwargs)

    def append(self, value: Any) -> None:
        self.__dict__["items"].append(value)

    def extend(self, values: Any) -> None:
        self.__dict__["items"].extend(values)

    def __repr__(self) -> str:
        return f"<{self.pickled_as}, not loaded>"


_placeholders: dict[tuple[str, str], type[Inert]] = {}


def placeholder(module: str, name: str) -> type[Inert]:
    """The Inert subclass standing in for `module.name` (one per name, so enums compare equal)."""
    key = (module, name)
    if key not in _placeholders:
        _placeholders[key] = type(name, (Inert,), {"pickled_as": f"{module}.{name}", "__module__": __name__})
    return _placeholders[key]


class Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return placeholder(module, name)


def load(file: Any, **kwargs: Any) -> Any:
    """pickle.load with the restricted Unpickler (torch's legacy, non-zip format calls it)."""
    return Unpickler(file, **kwargs).load()


def load_rank_file(path: str | Path, mmap: bool = True) -> dict[str, Any]:
    """A rank file's top-level dict; tensors memory-mapped where the format allows."""
    mmap = mmap and zipfile.is_zipfile(path)
    try:
        state = torch.load(path, map_location="cpu", mmap=mmap, weights_only=False,
                           pickle_module=sys.modules[__name__])
    except Exception as err:  # whatever a damaged file makes torch or pickle raise: one sentence
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        raise OSError(f"{path} cannot be read as a torch checkpoint ({reason}); it is damaged or not a "
                      f"Megatron rank file.") from None
    if not isinstance(state, dict):
        raise OSError(f"{path} holds a {type(state).__name__}, not a Megatron rank file's dict.")
    return state
