"""The actor and its rollout engines on the same ranks (MindSpeed-RL's integrated mode).

One `generate` call, on every actor rank, in the order that keeps the peak lowest:
1. offload the gradients and optimizer state (`offload_train_grad` / `offload_train_optimizer`) of the actor
   and of a PPO critic beside it,
2. wake the engine's weights and sync the actor's into them if the actor has changed since the
   last sync (always after an update: a stale engine is the classic silent RL failure) or the
   engine no longer holds them (a level-2 sleep drops them: a second rollout in a step, or the
   one after a validation, would otherwise sample from undefined memory),
3. offload the actor's parameters and those of the models beside it (the reference, a colocated
   reward model, the critic) (`offload_train_param`) — the sync has read them; not when the engine
   generates with the actor's own model,
4. wake the engine's KV cache, now that the training state is off the device,
5. generate: each engine takes its share of the prompts (rollout data parallelism: world size /
   infer_tensor_parallel_size vLLM engines, or the actor's data-parallel replicas for the
   Megatron-native engine), and the shares are gathered so every rank returns the whole result; with
   multi-turn rollouts an agent loop drives each engine, and a turn's tools run once per engine, on its
   first rank, which hands the results to the others (they must feed the engine the same ids),
6. release the engine's memory and bring the training state back, bit for bit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from mindrl.data.images import PromptImages
from mindrl.models.dtypes import ENGINE_DTYPES
from mindrl.rollout.agent_loop import AgentLoop, AgentSpec
from mindrl.rollout.base import RolloutEngine, RolloutResult
from mindrl.rollout.config import GenerateConfig, SamplingConfig
from mindrl.rollout.engines import make_engine, resolve_backend
from mindrl.rollout.weight_sync import SyncStats, sync_weights
from mindrl.workers.engine_share import (
    build_agent_loop,
    close_engine,
    engine_config,
    engine_group,
    probe_failure,
    probe_tokens,
    timed_share,
)
from mindrl.workers.megatron_worker import ActorWorker, MegatronWorker

log = logging.getLogger(__name__)


class ColocatedRollout:
    def __init__(self, actor: ActorWorker, engine: RolloutEngine, cfg: GenerateConfig,
                 beside: Sequence[MegatronWorker] = (), agent: AgentSpec | None = None) -> None:
        world = dist.get_world_size()
        if not engine.shares_actor_weights and world % cfg.infer_tensor_parallel_size:
            raise ValueError(f"infer_tensor_parallel_size={cfg.infer_tensor_parallel_size} does not divide the "
                             f"{world} actor ranks the engines run on; choose a divisor of {world}.")
        self.actor, self.engine, self.cfg = actor, engine, engine_config(cfg, actor)
        #: the other models on the actor's devices (offloaded with it)
        self.beside = list(beside)
        self.dtype = ENGINE_DTYPES[self.cfg.dtype]
        self.synced_update: int | None = None  # the actor's update count the engine's weights come from
        self.last_sync: SyncStats | None = None
        self.agent = None if agent is None else self._agent_loop(agent)

    def _agent_loop(self, spec: AgentSpec) -> AgentLoop:
        group, _ = self._rollout_group()
        return build_agent_loop(self.engine, spec, group, self.actor.arch, self.cfg.max_model_len)

    @classmethod
    def build(cls, actor: ActorWorker, cfg: GenerateConfig, eos_token_ids: Sequence[int],
              beside: Sequence[MegatronWorker] = (), agent: AgentSpec | None = None) -> ColocatedRollout:
        """The configured engine on the actor's ranks (every actor rank calls this), driven by the actor. vLLM
        sizes its memory by what is free when it starts (and refuses to start below its share of the device), so
        the state the rollouts will offload is off the device while it starts too."""
        cfg = engine_config(cfg, actor)
        workers = (actor, *beside)
        params = cfg.offload_train_param and resolve_backend(cfg) == "vllm"  # the Megatron engine is the actor
        for worker in workers:
            worker.offload(params=params, grads=cfg.offload_train_grad, optimizer=cfg.offload_train_optimizer)
        try:
            engine = make_engine(actor.model, actor.arch, actor.par, cfg, eos_token_ids, actor.cfg.seed)
        finally:
            for worker in workers:
                worker.onload()
        return cls(actor, engine, cfg, beside, agent)

    def _rollout_group(self) -> tuple[int, int]:
        """(this rank's engine group, number of groups): the engines split the prompts between them.

        A vLLM engine spans infer_tensor_parallel_size ranks; the Megatron-native engine is the
        actor's own model, so each data-parallel replica of the actor is one, and under context parallelism each of
        its CP ranks (generation cuts no sequence: they are whole TP × PP models).
        """
        if self.engine.shares_actor_weights:
            cp = self.actor.par.cp
            return self.actor.dp_rank * cp + self.actor.cp_rank, self.actor.dp_size * cp
        return engine_group(self.cfg.infer_tensor_parallel_size)

    def generate(self, prompts: list[list[int]], n: int = 1, sampling: SamplingConfig | None = None,
                 images: list[PromptImages | None] | None = None,
                 max_tokens: list[int] | None = None) -> tuple[RolloutResult, dict[str, float]]:
        """The whole batch's responses on every rank (collective over the actor's ranks), and metrics; a
        vision-language model's prompts come with their images. `max_tokens` (one per prompt) continues partial
        responses (generate_share)."""
        sampling = sampling or self.cfg.sampling_config
        cfg, actor = self.cfg, self.actor
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        for worker in (actor, *self.beside):
            worker.offload(params=False, grads=cfg.offload_train_grad, optimizer=cfg.offload_train_optimizer)
        try:
            self.engine.resume_weights()
            if self.synced_update != actor.updates or not self.engine.holds_weights:
                metrics.update(self.sync())
            if cfg.offload_train_param and not self.engine.shares_actor_weights:
                for worker in (actor, *self.beside):
                    worker.offload(params=True, grads=False, optimizer=False)
            self.engine.resume_memory()
            generate_start = time.perf_counter()
            metrics["timing/resharding_to_infer"] = generate_start - start
            result, generated = self._generate_share(prompts, n, sampling, images, max_tokens)
            metrics.update(generated)
            start = time.perf_counter()
            self.engine.release_memory()
        finally:
            for worker in (actor, *self.beside):
                worker.onload()
        metrics["timing/resharding_to_train"] = time.perf_counter() - start
        return result, metrics

    def sync(self) -> dict[str, float]:
        """Move the actor's current weights into the engine (and check them if configured)."""
        stats = sync_weights(self.engine, self.actor.model, self.actor.arch, self.actor.par, self.dtype,
                             self.cfg.weight_sync_bucket_mb << 20, digests=self.cfg.check_weight_sync)
        self.synced_update, self.last_sync = self.actor.updates, stats
        metrics = stats.metrics()
        if self.cfg.check_weight_sync and not self.engine.shares_actor_weights:
            metrics.update(self._check(stats))
        return metrics

    def _generate_share(self, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                        images: list[PromptImages | None] | None,
                        max_tokens: list[int] | None = None) -> tuple[RolloutResult, dict[str, float]]:
        group, groups = self._rollout_group()
        return timed_share(self.agent or self.engine, group, groups, prompts, n, sampling, images, max_tokens)

    def close(self) -> None:
        """End the engine and its agent loop's tools; the rollout is unusable afterwards."""
        close_engine(self.engine, self.agent)

    def _check(self, stats: SyncStats) -> dict[str, float]:
        """Every rank's engine got the same bytes, and scores a probe sequence like the actor does."""
        everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, stats.digests)
        differing = sorted({name for other in everyone for name in stats.digests if other[name] != stats.digests[name]})
        probe = {"tokens": probe_tokens(self.actor.arch.padded_vocab_size, max(self.actor.dp_size, 1))}
        actor = self.actor.compute_log_prob(probe, temperature=1.0)
        engine = torch.tensor(self.engine.prompt_log_probs(probe["tokens"].tolist()))
        worst = torch.zeros(1, device=self.actor.platform.device())  # NCCL / HCCL reduce device tensors only
        if actor is not None:
            rows = self.actor.rows_for(probe, self.actor.batching)
            worst[0] = (actor["log_probs"][:, :-1] - engine[rows]).abs().max()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        metrics = {"sync/checked_tensors": float(len(stats.digests)), "sync/differing_tensors": float(len(differing)),
                   "sync/probe_max_abs_diff": worst.item()}
        failure = probe_failure(worst.item(), self.dtype, differing)
        if failure is not None:
            self.engine.abort_weight_update()
            self.synced_update = None
            raise failure
        return metrics
