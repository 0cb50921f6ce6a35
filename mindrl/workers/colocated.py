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

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mindrl.data.images import PromptImages
from mindrl.rollout.agent_loop import AgentLoop, AgentSpec, ToolTurns, run_here
from mindrl.rollout.base import RolloutEngine, RolloutResult
from mindrl.rollout.config import GenerateConfig, SamplingConfig
from mindrl.rollout.engines import make_engine, resolve_backend
from mindrl.rollout.weight_sync import SyncStats, WeightSyncError, sync_weights
from mindrl.workers.megatron_worker import ActorWorker, MegatronWorker

log = logging.getLogger(__name__)
T = TypeVar("T")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Largest |engine − actor| log-prob on the probe sequence a checked sync accepts, by engine dtype.
_PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.1}


class ColocatedRollout:
    def __init__(self, actor: ActorWorker, engine: RolloutEngine, cfg: GenerateConfig,
                 beside: Sequence[MegatronWorker] = (), agent: AgentSpec | None = None) -> None:
        world = dist.get_world_size()
        if not engine.shares_actor_weights and world % cfg.infer_tensor_parallel_size:
            raise ValueError(f"infer_tensor_parallel_size={cfg.infer_tensor_parallel_size} does not divide the "
                             f"{world} actor ranks the engines run on; choose a divisor of {world}.")
        self.actor, self.engine, self.cfg = actor, engine, _engine_dtype(cfg, actor)
        #: the other models on the actor's devices (offloaded with it)
        self.beside = list(beside)
        self.dtype = _DTYPES[self.cfg.dtype]
        self.synced_update: int | None = None  # the actor's update count the engine's weights come from
        self.last_sync: SyncStats | None = None
        self.agent = None if agent is None else self._agent_loop(agent)

    def _agent_loop(self, spec: AgentSpec) -> AgentLoop:
        """The loop around this rank's engine; the ranks of one engine share a gloo group through which the
        first of them hands the others each turn's tool results (collective: every rank builds one)."""
        from mindrl.data.tokenizer import load_tokenizer
        from mindrl.tools import load_toolbox

        group, _ = self._rollout_group()
        members: list[int | None] = [None] * dist.get_world_size()
        dist.all_gather_object(members, group)
        share, mine = run_here, [rank for rank, g in enumerate(members) if g == group]
        for g in dict.fromkeys(members):  # every rank creates every group, in the same order
            ranks = [rank for rank, other in enumerate(members) if other == g]
            handle = dist.new_group(ranks, backend="gloo") if len(ranks) > 1 else None
            if g == group and handle is not None:
                share = _shared_from(mine[0], handle)
        cfg = spec.cfg
        tools = load_toolbox(cfg.tool_config_path, cfg.max_parallel_calls, cfg.max_tool_response_length,
                             cfg.tool_response_truncate_side)
        turns = ToolTurns(load_tokenizer(spec.tokenizer_path, self.actor.arch), spec.tool_turn, cfg.tool_parser_format)
        return AgentLoop(self.engine, tools, turns, cfg, self.cfg.max_model_len, share)

    @classmethod
    def build(cls, actor: ActorWorker, cfg: GenerateConfig, eos_token_ids: Sequence[int],
              beside: Sequence[MegatronWorker] = (), agent: AgentSpec | None = None) -> ColocatedRollout:
        """The configured engine on the actor's ranks (every actor rank calls this), driven by the actor. vLLM
        sizes its memory by what is free when it starts (and refuses to start below its share of the device), so
        the state the rollouts will offload is off the device while it starts too."""
        cfg = _engine_dtype(cfg, actor)
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
        actor's own model, so each data-parallel replica of the actor is one.
        """
        if self.engine.shares_actor_weights:
            return self.actor.dp_rank, self.actor.dp_size
        tp = self.cfg.infer_tensor_parallel_size
        return dist.get_rank() // tp, dist.get_world_size() // tp

    def generate(self, prompts: list[list[int]], n: int = 1, sampling: SamplingConfig | None = None,
                 images: list[PromptImages | None] | None = None) -> tuple[RolloutResult, dict[str, float]]:
        """The whole batch's responses on every rank (collective over the actor's ranks), and metrics; a
        vision-language model's prompts come with their images."""
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
            result = self._generate_share(prompts, n, sampling, images)
            metrics["rollout/generate_seconds"] = time.perf_counter() - generate_start
            metrics["rollout/response_tokens"] = float(sum(len(r) for r in result.responses))
            if self.agent is not None:
                metrics["rollout/tool_seconds"] = self.agent.tool_seconds
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
                        images: list[PromptImages | None] | None) -> RolloutResult:
        group, groups = self._rollout_group()
        bounds = [len(prompts) * g // groups for g in range(groups + 1)]
        if sampling.seed is not None:  # sample r of the whole batch draws with seed + r, whichever engine has it
            sampling = dataclasses.replace(sampling, seed=sampling.seed + bounds[group] * n)
        mine = slice(bounds[group], bounds[group + 1])
        share = (self.agent or self.engine).generate(prompts[mine], sampling, n, images[mine] if images else None)
        shares: list[tuple[int, RolloutResult] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(shares, (group, share))
        by_group: dict[int, RolloutResult] = {}
        for index, result in shares:  # every rank of a group holds the same result: keep the first
            by_group.setdefault(index, result)
        return RolloutResult.joined([by_group[g] for g in range(groups)])

    def _check(self, stats: SyncStats) -> dict[str, float]:
        """Every rank's engine got the same bytes, and scores a probe sequence like the actor does."""
        everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, stats.digests)
        differing = sorted({name for other in everyone for name in stats.digests if other[name] != stats.digests[name]})
        probe = _probe_tokens(self.actor.arch.padded_vocab_size, max(self.actor.dp_size, 1))
        actor = self.actor.compute_log_prob({"tokens": probe}, temperature=1.0)
        engine = torch.tensor(self.engine.prompt_log_probs(probe.tolist()))
        worst = torch.zeros(1, device=self.actor.platform.device())  # NCCL / HCCL reduce device tensors only
        if actor is not None:
            rows = self.actor.local_rows(probe.shape[0])
            worst[0] = (actor["log_probs"][:, :-1] - engine[rows]).abs().max()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        metrics = {"sync/checked_tensors": float(len(stats.digests)), "sync/differing_tensors": float(len(differing)),
                   "sync/probe_max_abs_diff": worst.item()}
        if differing or worst.item() > _PROBE_TOLERANCE[self.dtype]:
            self.engine.abort_weight_update()
            self.synced_update = None
            raise WeightSyncError(
                f"weight sync check failed: {len(differing)} tensors differ between ranks' engines "
                f"(e.g. {differing[:3]}), probe log-probs differ from the actor's by up to {worst.item():.3g}; "
                f"the engine refuses to generate until the next complete sync.")
        return metrics


def _shared_from(leader: int, group: Any) -> Callable[[Callable[[], T]], T]:
    """Run on `leader` (a global rank), broadcast over `group` to its other ranks."""
    def share(make: Callable[[], T]) -> T:
        box = [make() if dist.get_rank() == leader else None]
        dist.broadcast_object_list(box, src=leader, group=group)
        return box[0]

    return share


def _probe_tokens(vocab: int, rows: int, length: int = 24) -> torch.Tensor:
    """A fixed sequence per data-parallel rank spread over the whole vocabulary."""
    positions = torch.arange(rows * length, dtype=torch.int64).view(rows, length)
    return (positions * 7919 + 13) % vocab


def _engine_dtype(cfg: GenerateConfig, actor: ActorWorker) -> GenerateConfig:
    return cfg.engine_dtype(actor.model.config.params_dtype == torch.bfloat16)
