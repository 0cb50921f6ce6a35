"""The ranks Ray actors host: a policy rank (actor + reference + rollout engine, and PPO's critic when
it has no devices of its own), a reference rank, a critic rank, a reward-model rank, an SFT rank (the
actor alone, taught responses) or a DPO rank (the actor and its frozen reference, taught preferences).

A policy rank is MindSpeed-RL's integrated worker: the Megatron actor, the reference beside it
when the KL loss needs one, the reward model when every model shares the actor's devices
(colocate_all_models), and the rollout engine the actor's weights are synced into. A
reference rank serves a reference on devices of its own, in its own layout. The driver calls
every method on every rank of a group at once (they are collectives); a method's result is
the same on every rank unless it says otherwise.

The reference is the weights the run started from, whatever the actor has become: built
from the initial checkpoint, or copied from the actor's random initialisation before any
checkpoint is loaded into the actor — never reloaded from a path the run has since written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mindrl.algorithms.dpo_loss import DPOLossConfig, sequence_log_probs
from mindrl.algorithms.value_loss import ValueLossConfig
from mindrl.config import ModelArch, ParallelConfig
from mindrl.config.batching import Batching
from mindrl.data.images import PromptImages
from mindrl.distributed import agreed_precision, destroy, init_distributed
from mindrl.launch import rendezvous_store
from mindrl.models.dtypes import DTYPES, ENGINE_DTYPES
from mindrl.models.gpt import load_stage_weights
from mindrl.models.lora import merged_parameters
from mindrl.platform.precision import Precision
from mindrl.rollout.agent_loop import AgentSpec
from mindrl.rollout.base import RolloutResult
from mindrl.rollout.config import GenerateConfig, SamplingConfig
from mindrl.rollout.weight_push import PushGroup, push_weights
from mindrl.workers.engine_share import engine_config, probe_tokens
from mindrl.workers.group import COLLECTIVE_TIMEOUT_S
from mindrl.workers.megatron_worker import ActorConfig, BackboneReference, MegatronWorker
from mindrl.workers.profiling import PhaseTracing

#: (data-parallel rank, its rows' results, which rows of the batch they are; mindrl.workers.group.gather_rows puts
#: them back in the batch's order) on the ranks that hold results, None on the others
Held = tuple[int, torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class RewardSpec:
    arch: ModelArch
    par: ParallelConfig
    #: the reward_config's bf16 setting: true, false or auto (the ranks decide, mindrl.platform.precision)
    bf16: bool | str
    #: Megatron checkpoint root of the reward model (cli/convert_ckpt.py --orm), in this role's layout
    weights: str
    micro_batch_size: int
    seed: int
    batching: Batching = field(default_factory=Batching)


@dataclass(frozen=True)
class CriticSpec:
    #: critic_config's architecture (the actor's unless it names another), ending in a one-output value head
    arch: ModelArch
    par: ParallelConfig
    cfg: ActorConfig
    loss: ValueLossConfig
    #: critic_config.bf16: true, false or auto (the ranks decide, mindrl.platform.precision)
    bf16: bool | str
    #: Megatron checkpoint root to start from (mindrl/workers/critic_worker.py); None: random initialisation
    weights: str | None
    #: the critic's training checkpoint root to resume from, at the actor's iteration
    resume: str | None = None
    resume_iteration: int | None = None
    #: whether the run resumed was trained in bf16 (bf16: auto keeps it)
    resume_bf16: bool | None = None
    load_optim: bool = True
    load_rng: bool = True


class CriticHost:
    """A rank holding PPO's critic (`self.critic`): in the actor's processes, or on devices of its own."""

    critic = None

    def _build_critic(self, spec: CriticSpec) -> Precision:
        from mindrl.workers.critic_worker import CriticWorker

        precision = agreed_precision(spec.bf16, "critic_config", spec.resume_bf16)
        self.critic = CriticWorker(spec.arch, spec.par, spec.cfg, spec.loss, spec.weights, RankProcess.dtype(precision))
        if spec.resume is not None:
            self.critic.load_checkpoint(spec.resume, spec.resume_iteration, spec.load_optim, spec.load_rng)
        return precision

    def values(self, batch: dict) -> Held:
        with self.traced("critic_compute_values"):
            return _held(self.critic, self.critic.compute_values(batch), batch)

    def update_critic(self, batch: dict) -> dict[str, float]:
        with self.traced("critic_update"):
            return self.critic.update(batch)

    def save_critic(self, root: str, iteration: int, extra: dict) -> str:
        return str(self.critic.save_checkpoint(root, iteration, extra))

    def finish_critic_saves(self) -> None:
        """Publish the critic's asynchronous save, once its writes are done on every rank."""
        if self.critic is not None:
            self.critic.finish_saves()


@dataclass(frozen=True)
class PolicySpec:
    arch: ModelArch
    par: ParallelConfig
    actor: ActorConfig
    generate: GenerateConfig
    #: actor_config.bf16: true, false or auto (the ranks decide, mindrl.platform.precision)
    bf16: bool | str
    eos_token_ids: tuple[int, ...]
    #: Megatron checkpoint root of the weights the run starts from; None: random initialisation from the seed
    initial_weights: str | None
    with_reference: bool
    ref_micro_batch_size: int
    actor_micro_batch_size: int
    #: how the reference's and the actor's log-prob passes cut their rows (the update's: actor.batching)
    ref_batching: Batching = field(default_factory=Batching)
    actor_batching: Batching = field(default_factory=Batching)
    #: training checkpoint root to resume the actor from (None: a fresh start)
    resume: str | None = None
    resume_iteration: int | None = None
    #: whether the checkpoint resumed was trained in bf16 (bf16: auto keeps it)
    resume_bf16: bool | None = None
    load_optim: bool = True
    load_rng: bool = True
    #: a reward model hosted beside the actor (colocate_all_models), in the actor's TP/PP layout
    reward: RewardSpec | None = None
    #: PPO's critic hosted beside the actor (no critic_resource), in the actor's TP/PP layout
    critic: CriticSpec | None = None
    #: the reference is the actor with its LoRA adapters off (rl_config.share_backbone): no second model
    share_backbone: bool = False
    #: rollouts call tools between turns (rl_config.multi_turn_enable)
    agent: AgentSpec | None = None
    #: the rollout engines run on ranks of their own (rollout_rank.py) and take the actor's weights by push: the
    #: actor's ranks build no engine and do not generate
    rollout_elsewhere: bool = False


class RankProcess(PhaseTracing):
    """What every rank of a group does: say where it runs, publish or join the rendezvous, and trace its phases
    where profiler_config asks (mindrl/workers/profiling.py)."""

    def __init__(self, rank: int, world_size: int, device: str) -> None:
        self.rank, self.world_size = rank, world_size
        # every later get_platform() of this process (megatron's patches, the engines) names the same kind
        self.device = os.environ["MINDRL_DEVICE"] = device
        self._store: dist.TCPStore | None = None
        self._push_store: dist.TCPStore | None = None
        #: this rank's membership of the group the actor's weights are pushed over (join_push)
        self.push: PushGroup | None = None
        # every process of a run writes to its log: this line tells which lines (torch's carry the pid) are whose
        print(f"[mindrl] pid {os.getpid()}: {type(self).__name__} {rank} of {world_size}", flush=True)

    def node(self) -> str:
        """This rank's node as its address (its Ray node id's prefix after it), for placement and messages."""
        import ray

        return f"{ray.util.get_node_ip_address()} ({ray.get_runtime_context().get_node_id()[:8]})"

    def rendezvous(self, loopback: bool, timeout_s: float) -> tuple[str, int]:
        """Rank 0 serves the group's store on a port the OS picks; the driver hands it to the others."""
        host = _store_host(loopback)
        self._store = rendezvous_store(self.world_size, timeout_s, host)
        return host, self._store.port

    def serve_push(self, world: int, loopback: bool, timeout_s: float) -> tuple[str, int]:
        """Serve the store of a push group of `world` members (mindrl/rollout/weight_push.py), apart from this
        rank's own group's, on a port the OS picks; the driver hands it to every member."""
        host = _store_host(loopback)
        self._push_store = rendezvous_store(world, timeout_s, host)
        return host, self._push_store.port

    def join_push(self, host: str, port: int, world: int, rank: int, actors: int,
                  timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        """Become `rank` of the push group of `world`, whose first `actors` members are the actor's ranks and the
        rest the rollout ranks; every member at once."""
        from mindrl.rollout.weight_push import PushGroup

        self.push = PushGroup(host, port, world, rank, actors, timeout_s)

    def join(self, host: str, port: int, timeout_s: float) -> None:
        from mindrl.platform import get_platform

        # Ray shows each actor only its own device(s), so the device index inside the process is 0.
        init_distributed(self.rank, self.world_size, host, port, local_rank=0, platform=get_platform(self.device),
                         timeout_s=timeout_s, store_is_served=True)

    @staticmethod
    def dtype(precision: Precision) -> torch.dtype:
        return DTYPES[precision.params_dtype]


class ActorRank(RankProcess):
    """A rank hosting a trained actor (`self.actor`): resuming it and saving its checkpoints."""

    def _resume(self, spec: PolicySpec | SFTSpec) -> dict:
        """Load the training checkpoint the spec names, if any: the trainer state saved with it (`extra`, None
        without a resume) and a sentence where its LR schedule differs from the config's (`schedule_note`)."""
        if spec.resume is None:
            return {"extra": None, "schedule_note": None}
        extra = self.actor.load_checkpoint(spec.resume, spec.resume_iteration, spec.load_optim, spec.load_rng).extra
        return {"extra": extra, "schedule_note": self.actor.kept_schedule()}

    def save(self, root: str, iteration: int, extra: dict) -> str:
        return str(self.actor.save_checkpoint(root, iteration, extra))

    def finish_saves(self) -> None:
        """Publish the actor's asynchronous save, once its writes are done on every rank (before an export reads
        the last checkpoint)."""
        self.actor.finish_saves()


class PolicyRank(ActorRank, CriticHost):
    def setup(self, host: str, port: int, spec: PolicySpec, timeout_s: float) -> dict:
        """Join the group, build the models and the engine, and resume if asked; returns the data-parallel
        size and, on a resume, the trainer state saved with the checkpoint."""
        from mindrl.workers.colocated import ColocatedRollout
        from mindrl.workers.megatron_worker import ActorWorker

        self.join(host, port, timeout_s)
        precision = agreed_precision(spec.bf16, "actor_config", spec.resume_bf16)
        dtype = self.dtype(precision)
        self.actor = ActorWorker(spec.arch, spec.par, spec.actor, spec.initial_weights, dtype)
        # its log-prob passes; updates use cfg's
        self.actor.micro_batch_size, self.actor.batching = spec.actor_micro_batch_size, spec.actor_batching
        self.reference = None
        if spec.with_reference and spec.share_backbone:
            self.reference = BackboneReference(self.actor, spec.ref_micro_batch_size, spec.ref_batching)
        elif spec.with_reference:
            self.reference = MegatronWorker(spec.arch, spec.par, None, dtype, spec.actor.temperature,
                                            spec.ref_micro_batch_size, spec.actor.seed, spec.actor.prompt_packing,
                                            spec.ref_batching)
            load_stage_weights(self.reference.model, dict(merged_parameters(self.actor.model)))
        self.reward = None
        if spec.reward is not None:
            from mindrl.workers.reward_worker import RewardModelWorker

            reward = spec.reward
            self.reward = RewardModelWorker(reward.arch, reward.par, reward.weights,
                                            self.dtype(agreed_precision(reward.bf16, "reward_config")),
                                            reward.micro_batch_size, reward.seed, reward.batching)
        if spec.critic is not None:  # before the actor resumes: the actor's random generators are the ones restored
            self._build_critic(spec.critic)
        resumed = self._resume(spec)
        beside = [worker for worker in (self.reference, self.reward, self.critic)
                  if worker is not None and not isinstance(worker, BackboneReference)]
        self.engine_cfg = engine_config(spec.generate, self.actor)
        self.rollout = None
        if not spec.rollout_elsewhere:
            self.rollout = ColocatedRollout.build(self.actor, spec.generate, spec.eos_token_ids, beside, spec.agent)
        return {"dp_size": self.actor.dp_size, **resumed, "precision": precision, "engine_dtype": self.engine_cfg.dtype}

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                 images: list[PromptImages | None] | None = None,
                 max_tokens: list[int] | None = None) -> tuple[RolloutResult, dict]:
        if self.rollout is None:
            raise RuntimeError("this actor's rollout engines run on ranks of their own (PolicySpec.rollout_elsewhere): "
                               "generate through the rollout role (mindrl.trainer.rollout_role.RolloutRole), not the "
                               "actor.")
        with self.traced("actor_generate"):
            return self.rollout.generate(prompts, n, sampling, images, max_tokens)

    def push_weights(self, version: int) -> dict[str, float]:
        """Send the actor's current weights, as policy `version`, to the rollout ranks of the push group (every
        actor rank at once, with RolloutRank.receive_weights); the push's time and bytes."""
        cfg = self.engine_cfg
        stats = push_weights(self.push, self.actor.model, self.actor.arch, self.actor.par, ENGINE_DTYPES[cfg.dtype],
                             cfg.weight_sync_bucket_mb << 20, version)
        return stats.metrics()

    def probe_log_probs(self, rows: int) -> Held:
        """The actor's log-probs of the probe sequence (engine_share.probe_tokens, `rows` of them: one per
        data-parallel rank) at temperature 1, on the ranks that hold results: what a pushed engine must match."""
        probe = {"tokens": probe_tokens(self.actor.arch.padded_vocab_size, rows)}
        out = self.actor.compute_log_prob(probe, temperature=1.0)
        return _held(self.actor, None if out is None else out["log_probs"], probe)

    def log_probs(self, batch: dict, role: str) -> Held:
        with self.traced("actor_compute_log_prob" if role == "actor" else "reference_compute_log_prob"):
            return _rows_of(self.actor if role == "actor" else self.reference, batch)

    def update(self, batch: dict) -> dict[str, float]:
        with self.traced("actor_update"):
            return self.actor.update(batch)

    def score(self, batch: dict) -> Held:
        return _held(self.reward, self.reward.score(batch), batch)

    def close(self) -> None:
        try:
            if self.rollout is not None:
                self.rollout.close()
        finally:
            destroy()


@dataclass(frozen=True)
class ReferenceSpec:
    arch: ModelArch
    par: ParallelConfig
    #: ref_config.bf16: true, false or auto (the ranks decide, mindrl.platform.precision)
    bf16: bool | str
    #: Megatron checkpoint root of the run's initial weights, in this role's layout
    weights: str
    temperature: float
    micro_batch_size: int
    seed: int
    prompt_packing: str = "auto"
    batching: Batching = field(default_factory=Batching)


class CriticRank(RankProcess, CriticHost):
    """PPO's critic on devices of its own (rl_config.critic_resource), in its own layout."""

    def setup(self, host: str, port: int, spec: CriticSpec, timeout_s: float) -> dict:
        self.join(host, port, timeout_s)
        precision = self._build_critic(spec)
        return {"dp_size": self.critic.dp_size, "precision": precision}

    def close(self) -> None:
        destroy()


class RewardRank(RankProcess):
    """A reward model on devices of its own (rl_config.reward_resource)."""

    def setup(self, host: str, port: int, spec: RewardSpec, timeout_s: float) -> dict:
        from mindrl.workers.reward_worker import RewardModelWorker

        self.join(host, port, timeout_s)
        precision = agreed_precision(spec.bf16, "reward_config")
        self.reward = RewardModelWorker(spec.arch, spec.par, spec.weights, self.dtype(precision),
                                        spec.micro_batch_size, spec.seed, spec.batching)
        return {"dp_size": self.reward.dp_size, "precision": precision}

    def score(self, batch: dict) -> Held:
        return _held(self.reward, self.reward.score(batch), batch)

    def close(self) -> None:
        destroy()


class ReferenceRank(RankProcess):
    """A reference on devices of its own (use_integrated_worker: false)."""

    def setup(self, host: str, port: int, spec: ReferenceSpec, timeout_s: float) -> dict:
        self.join(host, port, timeout_s)
        precision = agreed_precision(spec.bf16, "ref_config")
        self.reference = MegatronWorker(spec.arch, spec.par, spec.weights, self.dtype(precision),
                                        spec.temperature, spec.micro_batch_size, spec.seed, spec.prompt_packing,
                                        spec.batching)
        return {"dp_size": self.reference.dp_size, "precision": precision}

    def log_probs(self, batch: dict) -> Held:
        with self.traced("reference_compute_log_prob"):
            return _rows_of(self.reference, batch)

    def close(self) -> None:
        destroy()


@dataclass(frozen=True)
class SFTSpec:
    arch: ModelArch
    par: ParallelConfig
    actor: ActorConfig
    #: megatron_training.bf16: true, false or auto (the ranks decide, mindrl.platform.precision)
    bf16: bool | str
    #: Megatron checkpoint root of the start weights; None: random initialisation from the seed
    initial_weights: str | None
    resume: str | None = None
    resume_iteration: int | None = None
    #: whether the checkpoint resumed was trained in bf16 (bf16: auto keeps it)
    resume_bf16: bool | None = None
    load_optim: bool = True
    load_rng: bool = True


class SFTRank(ActorRank):
    """The Megatron actor under supervised fine-tuning; it writes the checkpoints GRPO starts from."""

    def setup(self, host: str, port: int, spec: SFTSpec, timeout_s: float) -> dict:
        from mindrl.workers.megatron_worker import ActorWorker

        self.join(host, port, timeout_s)
        precision = agreed_precision(spec.bf16, "megatron_training", spec.resume_bf16)
        self.actor = ActorWorker(spec.arch, spec.par, spec.actor, spec.initial_weights, self.dtype(precision))
        return {"dp_size": self.actor.dp_size, **self._resume(spec), "precision": precision}

    def step(self, batch: dict) -> dict[str, float]:
        return self.actor.sft_step(batch)

    def close(self) -> None:
        destroy()


@dataclass(frozen=True)
class DPOSpec(SFTSpec):
    loss: DPOLossConfig = field(default_factory=DPOLossConfig)
    #: Megatron checkpoint root of the reference, in the actor's layout; None: the weights the run started from
    reference: str | None = None
    #: the reference is the actor with its LoRA adapters off (share_backbone): no second model
    share_backbone: bool = False


class DPORank(SFTRank):
    """The Megatron actor under DPO, with its frozen reference beside it in the same processes and layout."""

    def setup(self, host: str, port: int, spec: DPOSpec, timeout_s: float) -> dict:
        from mindrl.workers.megatron_worker import ActorWorker

        self.join(host, port, timeout_s)
        precision = agreed_precision(spec.bf16, "megatron_training", spec.resume_bf16)
        dtype = self.dtype(precision)
        self.actor = ActorWorker(spec.arch, spec.par, spec.actor, spec.initial_weights, dtype)
        self.loss = spec.loss
        if spec.share_backbone:
            self.reference = BackboneReference(self.actor, spec.actor.micro_batch_size)
        else:
            self.reference = MegatronWorker(spec.arch, spec.par, spec.reference, dtype, 1.0,
                                            spec.actor.micro_batch_size, spec.actor.seed, spec.actor.prompt_packing,
                                            spec.actor.batching)
            if spec.reference is None:  # the weights the run started from, copied before a resume loads others
                load_stage_weights(self.reference.model, dict(merged_parameters(self.actor.model)))
        return {"dp_size": self.actor.dp_size, **self._resume(spec), "precision": precision}

    def step(self, batch: dict) -> dict[str, float]:
        """The reference's log-probs of this rank's rows (once per batch, no graph), then the actor's DPO step."""
        rows = self.reference.local_rows(batch["tokens"].shape[0])
        ref = self.reference.compute_log_prob(batch)
        full = torch.zeros(batch["tokens"].shape, dtype=torch.float32)
        if ref is not None:  # the last pipeline stage, the only one that computes the loss
            full[rows] = ref["log_probs"]
        return self.actor.dpo_step({**batch, "ref_log_probs": full}, self.loss)

    def sequence_log_probs(self, batch: dict) -> Held:
        """(data-parallel rank, [its rows, 2]: the policy's and the reference's response log-probs) on the ranks
        that hold results: what held-out pairs are judged by."""
        actor, reference = self.actor.compute_log_prob(batch), self.reference.compute_log_prob(batch)
        if actor is None:
            return None
        mask = batch["loss_mask"][self.actor.local_rows(batch["tokens"].shape[0])]
        both = torch.stack([sequence_log_probs(self.loss, actor["log_probs"], mask),
                            sequence_log_probs(self.loss, reference["log_probs"], mask)], -1)
        return _held(self.actor, both, batch)


def _store_host(loopback: bool) -> str:
    """Where a store a group's members reach is served: loopback when they all share this node."""
    import ray

    return "127.0.0.1" if loopback else ray.util.get_node_ip_address()


def _rows_of(worker: MegatronWorker | BackboneReference, batch: dict) -> Held:
    """(data-parallel rank, log-probs of its rows) on the ranks that hold results."""
    out = worker.compute_log_prob(batch)
    return _held(worker, None if out is None else out["log_probs"], batch)


def _held(worker: MegatronWorker | BackboneReference, rows: torch.Tensor | None, batch: dict) -> Held:
    """(data-parallel rank, its rows' results, which rows of `batch` they are) on the one rank per data-parallel
    rank that returns them (last stage, TP and CP rank 0); None elsewhere."""
    if rows is None or worker.tp_rank != 0 or worker.cp_rank != 0:
        return None
    return worker.dp_rank, rows, worker.rows_for(batch, worker.batching)
