"""Ascend NPUs: torch_npu, HCCL, Ray's NPU resource.

torch_npu registers the `npu` device and transfers megatron-core's `torch.cuda` calls to
the NPU on import, so importing it is all this backend needs to apply.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from mindrl.platform.base import Platform


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
                "`pip install -e .[npu]` (torch-npu and vllm-ascend) or choose MINDRL_DEVICE=cpu/cuda."
            ) from err

    def setup(self) -> None:
        self._import_torch_npu()

    def device(self, local_rank: int = 0) -> torch.device:
        self._import_torch_npu()
        return torch.device("npu", local_rank % max(torch.npu.device_count(), 1))

    def set_device(self, local_rank: int = 0) -> None:
        torch.npu.set_device(self.device(local_rank))

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def memory_allocated(self) -> int:
        return torch.npu.memory_allocated()

    def empty_cache(self) -> None:
        torch.npu.empty_cache()
