"""NVIDIA GPUs: NCCL, one device per process, Ray's GPU resource."""

from __future__ import annotations

import torch

from mindrl.platform.base import Platform
from mindrl.platform.precision import Bf16Speed


class CudaPlatform(Platform):
    name = "cuda"
    dist_backend = "nccl"
    ray_resource = "GPU"
    sdpa_enable_gqa = True  # torch's flash and memory-efficient kernels read each K/V head once per group

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def device_count() -> int:
        return torch.cuda.device_count()

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))

    def bf16_speed(self) -> Bf16Speed:
        # Without emulation: torch's default also says yes where bf16 merely loads (pre-Ampere), then runs slowly.
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return Bf16Speed(True, f"{name} computes bf16 natively")
        major, minor = torch.cuda.get_device_capability()
        return Bf16Speed(False, f"{name} (compute capability {major}.{minor}) has no native bf16; it needs 8.0")

    def set_device(self, local_rank: int = 0) -> None:
        torch.cuda.set_device(self.device(local_rank))

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()
