"""Ascend NPUs: torch_npu, HCCL, Ray's NPU resource.

`import torch_npu` only registers the `npu` device: megatron-core's `torch.cuda.*` calls,
`device="cuda"` tensors and `.cuda()` would still go to CUDA and fail. Like MindSpeed's
megatron adaptor (mindspeed/megatron_adaptor.py), this backend imports
`torch_npu.contrib.transfer_to_npu`, which redirects those calls to the NPU, and makes
`Tensor.type()` report `torch.cuda.*` names, which megatron-core's optimizers compare against.

One call escapes the redirect: megatron's model-parallel RNG tracker sets the device generator's state
through torch.cuda's private `_lazy_call` and `default_generators`, which transfer_to_npu does not map (on
an NPU host torch.cuda has no generators: the seed fails, or is silently dropped). Its two state functions
are replaced by the NPU's own, as Ascend's adaptors do.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from mindrl.platform.base import Platform
from mindrl.platform.precision import Bf16Speed

_type_names_patched = False


def cuda_type_name(name: Any) -> Any:
    """`torch.npu.BFloat16Tensor` → `torch.cuda.BFloat16Tensor`; anything else unchanged."""
    return name.replace("torch.npu.", "torch.cuda.") if isinstance(name, str) else name


def _reporting_cuda_names(type_method: Callable) -> Callable:
    @functools.wraps(type_method)
    def type_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = type_method(tensor, *args, **kwargs)
        return cuda_type_name(result) if not args and not kwargs else result

    return type_


class NpuPlatform(Platform):
    name = "npu"
    dist_backend = "hccl"
    ray_resource = "NPU"

    @staticmethod
    def available() -> bool:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        NpuPlatform._import_torch_npu()
        return torch.npu.is_available()

    @staticmethod
    def _import_torch_npu():
        try:
            return importlib.import_module("torch_npu")
        except ImportError as err:
            raise RuntimeError(
                "The NPU platform needs torch_npu, which is not installed; install mindrl with "
                "`pip install -e .[npu]` (torch-npu) or choose MINDRL_DEVICE=cpu/cuda."
            ) from err

    def setup(self) -> None:
        global _type_names_patched
        self._import_torch_npu()
        importlib.import_module("torch_npu.contrib.transfer_to_npu")
        _patch_rng_state()
        if not _type_names_patched:
            torch.Tensor.type = _reporting_cuda_names(torch.Tensor.type)
            _type_names_patched = True

    @staticmethod
    def device_count() -> int:
        NpuPlatform._import_torch_npu()
        return torch.npu.device_count()

    def device(self, local_rank: int = 0) -> torch.device:
        self._import_torch_npu()
        return torch.device("npu", local_rank % max(torch.npu.device_count(), 1))

    def bf16_speed(self) -> Bf16Speed:
        name = torch.npu.get_device_name()
        if torch.npu.is_bf16_supported():
            return Bf16Speed(True, f"{name} computes bf16 natively")
        return Bf16Speed(False, f"{name} has no native bf16")

    def set_device(self, local_rank: int = 0) -> None:
        torch.npu.set_device(self.device(local_rank))

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def memory_allocated(self) -> int:
        return torch.npu.memory_allocated()

    def empty_cache(self) -> None:
        torch.npu.empty_cache()


def _patch_rng_state() -> None:
    """megatron's RNG tracker reads and writes the NPU generator's state."""
    from megatron.core.tensor_parallel import random as mp_random

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.npu.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.npu.set_rng_state(new_state)

    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = set_state
