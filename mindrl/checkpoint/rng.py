"""Every random generator a training rank draws from, captured and restored for exact resume.

The states are plain tensors, numbers and tuples, so a checkpoint holding them loads with
torch.load(weights_only=True): resuming never runs code from the files. The device's own
generator is reached through the platform's device, so no device kind is named here; on CPU
it is the torch generator already captured.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from megatron.core import tensor_parallel

from mindrl.platform import get_platform


def _device_module() -> Any:
    device = get_platform().device()
    return None if device.type == "cpu" else torch.get_device_module(device)


def capture() -> dict[str, Any]:
    """This process's generator states (Megatron's checkpoint names, the device one renamed)."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    device = _device_module()
    tracker = tensor_parallel.get_cuda_rng_tracker()  # Megatron's model-parallel tracker, on any device
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                         "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch_rng_state": torch.get_rng_state(),
        "device_rng_state": None if device is None else device.get_rng_state().cpu(),
        "rng_tracker_states": {k: v.detach().cpu().clone() for k, v in tracker.get_states().items()},
    }


def restore(state: dict[str, Any]) -> None:
    """Put back what `capture` returned, generator by generator."""
    version, internal, gauss = state["random_rng_state"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["np_rng_state"]
    np.random.set_state((np_state["name"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch_rng_state"])
    device = _device_module()
    if device is not None and state["device_rng_state"] is not None:
        device.set_rng_state(state["device_rng_state"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.set_states({k: v.clone() for k, v in state["rng_tracker_states"].items()})
