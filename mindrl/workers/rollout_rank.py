"""Rollout engines on ranks of their own (disaggregated placement), for generation that runs while the actor trains.

The rollout ranks form a torch.distributed world of their own: infer_tensor_parallel_size ranks per vLLM engine,
world size / infer_tensor_parallel_size engines splitting each batch's prompts, the whole result on every rank (as in
the actor's ranks, engine_share.py). Weights arrive by push over a group shared with the actor's ranks
(mindrl/rollout/weight_push.py), each push tagged with the actor's update count, which every generate reports back
so a driver can tell which weights generated what. The Megatron-native engine generates with the actor's own model,
so it cannot live here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mindrl.config import ConfigError, ModelArch
from mindrl.data.images import PromptImages
from mindrl.rollout.agent_loop import AgentSpec
from mindrl.rollout.base import RolloutResult
from mindrl.rollout.config import GenerateConfig, SamplingConfig
from mindrl.rollout.engines import resolve_backend
from mindrl.rollout.weight_push import receive_weights
from mindrl.workers.engine_share import build_agent_loop, close_engine, engine_group, probe_tokens, timed_share
from mindrl.workers.ray_ranks import RankProcess


@dataclass(frozen=True)
class RolloutSpec:
    arch: ModelArch
    #: the engine's config, its dtype already resolved to the actor's (the actor's setup says which)
    generate: GenerateConfig
    eos_token_ids: tuple[int, ...]
    seed: int
    #: rollouts call tools between turns (rl_config.multi_turn_enable)
    agent: AgentSpec | None = None

    def __post_init__(self) -> None:
        if self.generate.dtype == "auto":
            raise ValueError("a rollout role's engine dtype must be resolved (the actor's setup returns it as "
                             "engine_dtype), not auto.")


def check_own_ranks(cfg: GenerateConfig) -> None:
    """Refuse what rollout ranks of their own cannot host: any engine but vLLM."""
    if resolve_backend(cfg) != "vllm":
        raise ConfigError(f"rollout engines on ranks of their own need generate_config.backend: vllm (with vLLM "
                          f"installed), but it resolves to megatron (backend: {cfg.backend}), whose engine generates "
                          f"with the actor's own model on the actor's ranks; install vLLM or keep the engines "
                          f"colocated with the actor.")


class RolloutRank(RankProcess):
    """One rank of the rollout role: part of one vLLM engine."""

    def setup(self, host: str, port: int, spec: RolloutSpec, timeout_s: float) -> dict:
        """Join the rollout ranks' own world and build this rank's engine; returns the number of engines."""
        from mindrl.rollout.vllm_engine import VllmEngine

        check_own_ranks(spec.generate)
        tp = spec.generate.infer_tensor_parallel_size
        if self.world_size % tp:
            raise ConfigError(f"infer_tensor_parallel_size={tp} does not divide the {self.world_size} rollout ranks; "
                              f"choose a divisor of {self.world_size}.")
        self.join(host, port, timeout_s)
        self.spec = spec
        self.group, self.groups = engine_group(tp)
        self.engine = VllmEngine(spec.arch, spec.generate, spec.eos_token_ids, seed=spec.seed)
        self.agent = None
        if spec.agent is not None:
            self.agent = build_agent_loop(self.engine, spec.agent, self.group, spec.arch, spec.generate.max_model_len)
        #: the policy version (the actor's update count) of the weights the engine holds; None before a push
        self.version: int | None = None
        return {"engines": self.groups}

    def receive_weights(self, version: int) -> dict[str, float]:
        """Take a push of policy `version` (every rollout rank at once, with PolicyRank.push_weights)."""
        self.version = None  # a push that fails part way leaves no version to report
        self.version, metrics = receive_weights(self.push, self.engine)
        if self.version != version:
            raise RuntimeError(f"the rollout ranks were told to expect weights version {version} but the actor "
                               f"pushed version {self.version}.")
        return {**metrics, "rollout/weight_version": float(self.version)}

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                 images: list[PromptImages | None] | None = None,
                 max_tokens: list[int] | None = None) -> tuple[RolloutResult, dict[str, float]]:
        """As ColocatedRollout.generate, with the policy version of the weights that generated it
        (`rollout/weight_version`)."""
        version = self.version
        with self.traced("actor_generate"):
            result, metrics = timed_share(self.agent or self.engine, self.group, self.groups, prompts, n, sampling,
                                          images, max_tokens)
        return result, {**metrics, "rollout/weight_version": float(version)}

    def probe_log_probs(self, rows: int) -> torch.Tensor:
        """The engine's log-probs of the probe sequence (`rows` of them), to compare with PolicyRank's."""
        probe = probe_tokens(self.spec.arch.padded_vocab_size, rows)
        return torch.tensor(self.engine.prompt_log_probs(probe.tolist()))

    def reject_weights(self) -> None:
        """The pushed weights failed their check: the engine refuses to generate until the next complete push."""
        self.engine.abort_weight_update()
        self.version = None

    def close(self) -> None:
        from mindrl.distributed import destroy

        try:
            close_engine(self.engine, self.agent)
        finally:
            destroy()
