"""Which rollout engine a run gets (`generate_config.backend`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from mindrl.config import ConfigError, ModelArch, ParallelConfig
from mindrl.rollout.base import RolloutEngine
from mindrl.rollout.config import VLLM_ROUTES, GenerateConfig

log = logging.getLogger(__name__)


def resolve_backend(cfg: GenerateConfig) -> str:
    """`auto` is vLLM where it is installed, else the Megatron-native engine."""
    from mindrl.rollout.vllm_engine import vllm_available

    if cfg.backend == "auto":
        return "vllm" if vllm_available() else "megatron"
    if cfg.backend == "vllm" and not vllm_available():
        raise ConfigError("generate_config.backend is vllm but vLLM is not installed here; install the extra for "
                          "this machine (cpu, gpu or npu) or set backend: megatron.")
    return cfg.backend


def make_engine(model: torch.nn.Module, arch: ModelArch, par: ParallelConfig, cfg: GenerateConfig,
                eos_token_ids: Sequence[int], seed: int, hf_config: dict[str, Any] | None = None) -> RolloutEngine:
    """The rollout engine for the ranks of an actor's `model` (built collectively: every actor rank calls this);
    the Megatron-native engine generates with that model itself, vLLM gets its weights by sync."""
    backend = resolve_backend(cfg)
    log.info("rollout backend: %s", backend)
    if backend == "megatron":
        from mindrl.rollout.megatron_engine import MegatronEngine

        return MegatronEngine(model, arch, par, eos_token_ids, cfg.max_model_len, cfg.max_num_seqs,
                              cfg.max_num_batched_tokens, record_routes=cfg.rollout_routing_replay)
    if cfg.rollout_routing_replay:
        raise ConfigError(VLLM_ROUTES)
    from mindrl.rollout.vllm_engine import VllmEngine

    return VllmEngine(arch, cfg, eos_token_ids, hf_config=hf_config, seed=seed)
