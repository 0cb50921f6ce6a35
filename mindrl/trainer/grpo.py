"""The GRPO driver: Ray worker groups, and the loop of `train_step`.

One step: prompts → rollout (the actor's weights synced into the engine, training state
offloaded meanwhile) → rule rewards on Ray CPU actors and the reward model, scored while the
reference and old log-prob passes run → advantages → optional truncated IS weights for the
engine/actor mismatch → actor update → metrics → checkpoint. With DAPO dynamic sampling the rollout
repeats on fresh prompts until the batch holds enough informative groups. A NaN or inf in the rewards, log-probs,
advantages, loss or gradient norm skips the rest of the step (mindrl/trainer/nonfinite.py).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mindrl.algorithms.advantages import compute_advantages
from mindrl.algorithms.decoupled import correction_weights, stale_tokens
from mindrl.algorithms.group_filter import GroupAccumulator, select_filter_values
from mindrl.algorithms.rollout_is import mismatch_metrics
from mindrl.algorithms.staleness import staleness_metrics
from mindrl.config import ConfigError, ModelArch
from mindrl.console import say
from mindrl.data.images import check_image_tokens
from mindrl.data.stops import response_text, run_stop_words, run_template, stop_token_ids, trajectory_text
from mindrl.rewards.scorer import ScoreResult
from mindrl.rollout.agent_loop import AgentSpec, check_data_announces
from mindrl.rollout.config import MultiTurnConfig, SamplingConfig, sampling_for_step
from mindrl.trainer.config import check_resources
from mindrl.trainer.experience import rollout_batch
from mindrl.trainer.export import export_hf
from mindrl.trainer.grpo_config import TrainerConfig, max_response_length
from mindrl.trainer.metrics import (
    METRICS_FILE,
    RESHARDING_PHASES,
    MetricsSink,
    StepTimer,
    actor_metrics,
    add_round,
    multi_turn_metrics,
    rollout_metrics,
    throughput_metrics,
)
from mindrl.trainer.nonfinite import NonFinite, SkippedSteps, first_nonfinite, skipped_update
from mindrl.trainer.profiling import StepProfiler
from mindrl.trainer.prompts import PromptLoader, check_prompt_lengths, images_of, read_prompts, split_path
from mindrl.trainer.schedule import batch_of, buffered_rows, saved_shape
from mindrl.trainer.start import JOB_GRPO, StartPoint, start_point
from mindrl.trainer.tracking import open_trackers


@dataclass
class Experience:
    batch: dict[str, torch.Tensor]
    scores: torch.Tensor
    verifier_scores: dict[str, torch.Tensor]
    metrics: dict[str, float]


def check_runnable(cfg: TrainerConfig) -> None:
    """What the driver cannot run yet, refused in one sentence before Ray starts."""
    rl = cfg.rl_config
    if cfg.reward_config is not None and rl.colocate_all_models:
        if not rl.use_integrated_worker:
            raise ConfigError("a reward model on the actor's devices (colocate_all_models) runs inside the actor's "
                              "processes; set use_integrated_worker: true, or give it its own reward_resource.")
        reward, actor = cfg.reward_config.parallel, cfg.actor_config.parallel
        if (reward.tp, reward.pp) != (actor.tp, actor.pp):
            raise ConfigError(f"a reward model on the actor's devices (colocate_all_models) runs in the actor's "
                              f"processes and layout, but its checkpoint is TP={reward.tp} PP={reward.pp} and the "
                              f"actor TP={actor.tp} PP={actor.pp}; re-shard it (cli/convert_ckpt.py mg -> mg).")
    if not rl.use_integrated_worker and cfg.colocate_actor_ref and rl.uses_reference:
        raise ConfigError("a reference sharing the actor's devices runs inside the actor's processes; set "
                          "use_integrated_worker: true, or give the reference its own reference_resource.")
    actor = cfg.actor_config
    actor.check_full_checkpoints("actor_config")
    if actor.data_path is None or actor.tokenizer_name_or_path is None:
        raise ConfigError("megatron_training.data_path and tokenizer_name_or_path are required to train; point them "
                          "at cli/preprocess_data.py's output and the tokenizer it used.")


def check_prompt_images(prompts: list, arch: ModelArch, tokenizer: Any, path: Path) -> None:
    """Image questions need a vision-language policy whose vision markers are the tokenizer's."""
    if images_of(prompts) is None:
        return
    if arch.vision is None:
        raise ConfigError(f"{path} holds image questions but actor_config's model {arch.name} has no vision tower; "
                          f"train a vision-language model (e.g. tiny_qwen25_vl) or use text-only data.")
    check_image_tokens(tokenizer, arch.vision, f"actor_config's model {arch.name}")


class GRPOTrainer:
    #: what this trainer's checkpoints say wrote them: only its own resume (mindrl/trainer/start.py)
    job = JOB_GRPO

    def __init__(self, cfg: TrainerConfig) -> None:
        from mindrl.data.tokenizer import load_tokenizer

        check_runnable(cfg)
        self.cfg = cfg
        actor = cfg.actor_config
        rl, self.n = cfg.rl_config, cfg.rl_config.n_samples_per_prompt
        self.start: StartPoint = start_point(actor, self.job)
        #: a reference on its own devices loads the run's first weights in its own layout
        self.ref_weights = None
        if rl.uses_reference and not rl.use_integrated_worker:
            self.ref_weights = cfg.ref_config.load or self.start.initial_weights
            if self.ref_weights is None:
                raise ConfigError("a reference on its own devices needs the run's initial weights as a checkpoint; "
                                  "set ref_config.load (or actor_config.load), or keep the reference in the actor "
                                  "with use_integrated_worker: true.")
        self.train_groups = cfg.train_batch_size
        # One optimizer step per batch, one epoch, no IS correction: the update's own forward pass
        # gives the old log-probs, so the separate pass is skipped.
        self.on_policy = rl.epochs == 1 and rl.mini_batch_size == self.train_groups and rl.rollout_is == "none" \
            and not rl.scheduled
        self.sampling: SamplingConfig = cfg.generate_config.sampling_config
        self.tokenizer = load_tokenizer(actor.tokenizer_name_or_path, actor.arch)
        train_path = split_path(actor.data_path, "train")
        #: where a response ends: the tokenizer's eos and the end of turn of the data's template
        self.stop_ids = stop_token_ids(self.tokenizer, run_stop_words(train_path, actor.prompt_type,
                                                                      actor.prompt_type_path))
        self.agent = agent_spec(rl.multi_turn(cfg.generate_config.max_model_len), train_path, actor, self.tokenizer)
        self.max_response = max_response_length(rl, cfg.generate_config)
        train_prompts = read_prompts(train_path)
        check_prompt_lengths(train_prompts, rl.max_prompt_length, train_path)
        check_prompt_images(train_prompts, actor.arch, self.tokenizer, train_path)
        self.loader = PromptLoader(train_prompts, actor.global_batch_size, actor.seed, shuffle=not actor.no_shuffle)
        if self.start.resume:
            self.loader.load_state_dict(self.start.extra["data"])
        #: prompts a scheduled run had buffered that this run, resuming it without a schedule, generates again
        self.handed_back = self._resume_buffer()
        test_path = split_path(actor.data_path, "test")
        self.test_prompts = read_prompts(test_path) if rl.test_interval and test_path.is_file() else []
        check_prompt_lengths(self.test_prompts, rl.max_prompt_length, test_path)
        self.group = self.ref_group = self.rewards = self.sink = None
        #: the rollout's schedule when it is not today's synchronous colocated one (mindrl/trainer/async_rollout.py)
        self.scheduled = None
        self.skipped = SkippedSteps(rl.max_nonfinite_steps)
        #: the iteration of the checkpoint a resume would start from (0: none yet)
        self.last_saved = self.start.iteration if self.start.resume else 0
        #: the reward model lives in the actor's ranks (colocate_all_models)
        self.reward_colocated = cfg.reward_config is not None and bool(rl.colocate_all_models)

    # ---------------------------------------------------------------- set-up and tear-down
    def _spec(self) -> Any:
        from mindrl.trainer.reward_model import reward_spec
        from mindrl.workers.ray_ranks import PolicySpec

        cfg, actor, rl = self.cfg, self.cfg.actor_config, self.cfg.rl_config
        return PolicySpec(
            arch=actor.arch, par=actor.parallel, actor=cfg.actor_update_config(), generate=cfg.generate_config,
            bf16=actor.bf16, eos_token_ids=self.stop_ids,
            initial_weights=self.start.initial_weights, with_reference=rl.uses_reference and self.ref_weights is None,
            ref_micro_batch_size=rl.ref_forward_micro_batch_size or actor.micro_batch_size,
            actor_micro_batch_size=rl.actor_forward_micro_batch_size or actor.micro_batch_size,
            ref_batching=rl.batching("ref"), actor_batching=rl.batching("actor"),
            resume=self.start.resume, resume_iteration=self.start.iteration if self.start.resume else None,
            resume_bf16=self.start.bf16, load_optim=not actor.no_load_optim, load_rng=not actor.no_load_rng,
            reward=reward_spec(cfg) if self.reward_colocated else None, share_backbone=rl.share_backbone,
            agent=self.agent, rollout_elsewhere=rl.resources["rollout_resource"] is not None)

    def setup(self) -> None:
        from mindrl.trainer.cluster import connect_when_ready
        from mindrl.trainer.reward_model import RewardModelGroup
        from mindrl.trainer.rewards import Rewards, RuleRewards
        from mindrl.workers.group import COLLECTIVE_TIMEOUT_S, WorkerGroup
        from mindrl.workers.ray_ranks import PolicyRank

        cfg, rl = self.cfg, self.cfg.rl_config
        resource = rl.resources["actor_resource"]
        connect_when_ready(lambda cluster: check_resources(cfg, cluster), rl.resource_wait_timeout,
                           rl.include_dashboard)
        cpus = 0.0 if resource.kind == "CPU" else rl.num_cpus_for_local_task
        # the scorers' processes start (and import the verifiers) while the ranks build their models: 1.7 s of
        # a tiny run's first step before; a reward model joins once the ranks it may share exist
        self.rewards = Rewards(RuleRewards(rl.reward, cpus, rl.phase_timeout) if rl.rule_reward else None, None,
                               rl.reward_model_weight, rl.reward_model_normalize, self.n)
        say(f"starting {resource.count} actor ranks ({resource}); "
            f"old log-probs: {'the update’s own forward (on-policy)' if self.on_policy else 'a separate pass'}")
        self.group = WorkerGroup("actor", PolicyRank, resource, phase_timeout_s=rl.phase_timeout)
        host, port = self.group.rendezvous(COLLECTIVE_TIMEOUT_S)
        ranks = self.group.call("setup", host, port, self._spec(), COLLECTIVE_TIMEOUT_S)
        self.dp_size = ranks[0]["dp_size"]
        say(f"{ranks[0]['precision'].line}; rollout engine in {ranks[0]['engine_dtype']}")
        if self.ref_weights is not None:
            self.ref_group = self._reference_group()
        if self.reward_colocated:
            self.rewards.model = RewardModelGroup(self.group, self.dp_size, owned=False)
        elif cfg.reward_config is not None:
            self.rewards.model = RewardModelGroup.on_own_devices(cfg)
        if cfg.rl_config.scheduled:
            self.scheduled = self._scheduled_rollout(ranks[0])
        if self.start.resume:
            extra = ranks[0]["extra"]
            if "reward_model_stats" in extra:
                self.rewards.stats.load_state_dict(extra["reward_model_stats"])
            if "skipped_steps" in extra:
                self.skipped.load_state_dict(extra["skipped_steps"])
            say(f"resumed from {self.start.resume} at iteration {self.start.iteration} "
                f"(epoch {self.loader.epoch}, prompt {self.loader.position})")
            if self.handed_back:
                say(f"the checkpoint's {self.handed_back} buffered prompts of a scheduled rollout are generated again "
                    f"under the resumed weights and trained (their partial responses, never trained on, are dropped)")
            if ranks[0]["schedule_note"]:
                say(f"warning: {ranks[0]['schedule_note']}")
        save = cfg.actor_config.save
        self.sink = MetricsSink(cfg.actor_config.train_iters, Path(save) / METRICS_FILE if save else None,
                                rl.tensorboard_dir if rl.use_tensorboard else None, self.start.iteration,
                                trackers=open_trackers(rl, save, cfg.stage, cfg))

    def _resume_buffer(self) -> int:
        """What a resume does with a scheduled run's buffered groups, decided before any worker starts: a schedule
        of the same shape takes them back; a run without a schedule generates their prompts again (the loader steps
        back over them, and their partial responses go); a schedule of another shape is refused. Returns the
        prompts handed back."""
        saved = (self.start.extra or {}).get("schedule")
        if saved is None or not saved["schedule"]["groups"]:
            return 0
        state, rl = saved["schedule"], self.cfg.rl_config
        n, batch = saved_shape(state, self.start.iteration)
        if rl.scheduled:
            if (n, batch) != (self.n, self.train_groups):
                raise ConfigError(f"{self.start.resume} iteration {self.start.iteration} holds "
                                  f"{len(state['groups'])} buffered groups of {n} samples from batches of {batch} "
                                  f"prompts, but this run asks n_samples_per_prompt={self.n} and batches of "
                                  f"{self.train_groups}; resume with n_samples_per_prompt={n} and global_batch_size="
                                  f"{batch}, which trains them, or without the schedule (rollout_mode: sync, "
                                  f"partial_rollout_max_split: 1, no rollout_resource), which generates their prompts "
                                  f"again.")
            return 0
        rows = buffered_rows(state)
        self.loader.rewind(rows, batch)
        return len(rows)

    def _scheduled_rollout(self, setup: dict) -> Any:
        """The rounds' driver, on the engines' own devices when rollout_resource gives them (their first weights
        pushed), else on the actor's; a resume takes back its buffered samples."""
        from mindrl.trainer.async_rollout import ScheduledRollout

        cfg, rl, role = self.cfg, self.cfg.rl_config, None
        resource = rl.resources["rollout_resource"]
        if resource is not None:
            from mindrl.trainer.rollout_role import RolloutRole
            from mindrl.workers.rollout_rank import RolloutSpec

            generate = replace(cfg.generate_config, dtype=setup["engine_dtype"])
            spec = RolloutSpec(cfg.actor_config.arch, generate, tuple(self.stop_ids), cfg.actor_config.seed,
                               self.agent)
            say(f"starting {resource.count} rollout ranks ({resource}), the actor's weights pushed to them")
            role = RolloutRole(self.group, self.dp_size, spec, resource, rl.phase_timeout)
        scheduled = ScheduledRollout(self.loader, self.n, self.train_groups, self.sampling, rl.rollout_mode,
                                     rl.staleness_bound, rl.partial_rollout_max_split, self.group, role,
                                     cfg.generate_config.check_weight_sync)
        saved = (setup["extra"] or {}).get("schedule")
        if saved is not None and saved_shape(saved["schedule"], self.start.iteration) == (self.n, self.train_groups):
            scheduled.load_state_dict(saved)
        else:  # a fresh start, a synchronous run's checkpoint or an empty schedule of another shape: every batch so
            # far was admitted and trained
            scheduled.resume_unscheduled(self.start.iteration, saved["rounds"] if saved else self.start.iteration)
        try:
            scheduled.start(self.start.iteration)
        except BaseException:  # close() only ends a rollout role it knows of
            if role is not None:
                role.kill()
            raise
        where = f"its own devices ({rl.resources['rollout_resource']})" if role else "the actor's devices"
        say(f"rollout: {rl.rollout_mode} on {where}, staleness bound {rl.staleness_bound} versions, responses in up "
            f"to {rl.partial_rollout_max_split} segments")
        return scheduled

    def _reference_group(self) -> Any:
        from mindrl.workers.group import COLLECTIVE_TIMEOUT_S, WorkerGroup
        from mindrl.workers.ray_ranks import ReferenceRank, ReferenceSpec

        ref, rl = self.cfg.ref_config, self.cfg.rl_config
        group = WorkerGroup("reference", ReferenceRank, rl.resources["reference_resource"],
                            phase_timeout_s=rl.phase_timeout)
        host, port = group.rendezvous(COLLECTIVE_TIMEOUT_S)
        spec = ReferenceSpec(ref.arch, ref.parallel, ref.bf16, self.ref_weights,
                             self.sampling.temperature, rl.ref_forward_micro_batch_size or ref.micro_batch_size,
                             ref.seed, rl.packing_mode, rl.batching("ref"))
        setup = group.call("setup", host, port, spec, COLLECTIVE_TIMEOUT_S)[0]
        self.ref_dp_size = setup["dp_size"]
        say(f"reference on its own {group.world_size} ranks, weights from {self.ref_weights}; "
            f"{setup['precision'].line}")
        return group

    def close(self) -> None:
        if self.scheduled is not None and self.scheduled.role is not None:
            self.scheduled.role.kill()
        if self.sink is not None:
            self.sink.close()
        if self.rewards is not None:
            self.rewards.close()
        for group in (self.group, self.ref_group):
            if group is not None:
                group.kill()

    def worker_groups(self) -> list[Any]:
        """Every group of ranks a step calls (the profiler tells each which step its calls belong to)."""
        role = self.scheduled.role if self.scheduled is not None else None
        return [group for group in (self.group, self.ref_group, role and role.group) if group is not None]

    # ---------------------------------------------------------------- the loop
    def fit(self) -> Path | None:
        """Train to train_iters; returns the final actor exported to HF (None without `save`)."""
        actor = self.cfg.actor_config
        try:
            self.setup()
            profiler = StepProfiler(self.cfg.profiler, self.worker_groups(), self.cfg.rl_config, self.on_policy)
            step = self.start.iteration
            while step < actor.train_iters:
                step += 1
                with profiler.step(step):
                    metrics = self.train_step(step)
                if self.test_prompts and step % self.cfg.rl_config.test_interval == 0:
                    metrics.update(self.validate())
                self.sink.log(step, metrics)
                if self.skipped.over:  # a graceful stop: the last checkpoint, if being written, is published first
                    self.finish_saves()
                self.skipped.stop_if_over(self.resume_hint())
                if actor.saves_at(step):
                    self.save(step)
            return self.export() if actor.save else None
        finally:
            self.close()

    def train_step(self, step: int) -> dict[str, float]:
        timer = StepTimer()
        updated: dict[str, float] = {}
        with timer("all"):
            exp = self.experience(step, timer)
            batch = exp.batch
            versions = batch.pop("token_versions", None)
            exp.metrics.update(multi_turn_metrics(batch))
            found = first_nonfinite({"the rewards": exp.scores, "the reference log-probs": batch.get("ref_log_probs"),
                                     "the old log-probs": batch.get("old_log_probs")})
            if found is None:
                exp.metrics.update(self.advantages(exp, timer))
                found = first_nonfinite({"the critic's values": batch.get("values"),
                                         "the advantages": batch["advantages"]})
            if found is None:
                gap = None
                if "old_log_probs" in batch:
                    exp.metrics.update(self.corrections(batch, versions, step - 1))
                    engine = batch.pop("engine_log_probs")
                    gap = None if versions is None else batch["old_log_probs"] - engine
                if versions is not None:
                    exp.metrics.update(staleness_metrics(versions, batch["loss_mask"], step - 1,
                                                         batch.get("rollout_is_weights"), gap))
                updated = self.update(step, batch, timer)
                found = update_nonfinite(updated)
            if self.scheduled is not None:  # the round in flight collected, the update's weights pushed
                updated = {**updated, **self.scheduled.after_update(step)}
        metrics = {**exp.metrics, **timer.metrics(), **updated, **self.skipped.record(step, found)}
        metrics["old_log_p/from_update"] = float("old_log_probs" not in batch)
        metrics["prompt_length/mean"] = batch["prompt_lengths"].double().mean().item()
        metrics.update(rollout_metrics(batch["response_lengths"], self.max_response, exp.scores,
                                       exp.verifier_scores))
        metrics.update(throughput_metrics(batch["prompt_lengths"], batch["response_lengths"],
                                          self.cfg.devices_held(), self.group.world_size, timer.seconds))
        if self.scheduled is not None:
            metrics.update(wait_shares(metrics))
        return metrics

    def corrections(self, batch: dict[str, torch.Tensor], versions: torch.Tensor | None,
                    version: int) -> dict[str, float]:
        """Put the loss's importance weights in place (decoupled PPO's for responses older than `version`, the
        synchronous step's for the rest: mindrl/algorithms/decoupled.py); returns the engine/trainer mismatch
        metrics of the tokens `version` sampled (a stale token's gap is staleness too, reported apart)."""
        rl, mask = self.cfg.rl_config, batch["loss_mask"]
        weights = correction_weights(batch["old_log_probs"], batch["engine_log_probs"], mask, rl.rollout_is_config,
                                     versions, version, rl.use_decoupled_loss, rl.behav_imp_weight_cap)
        if weights is not None:
            batch["rollout_is_weights"] = weights
        fresh = mask if versions is None else mask.bool() & ~stale_tokens(versions, mask, version)
        if versions is not None and not fresh.any():
            return {}
        return mismatch_metrics(batch["old_log_probs"], batch["engine_log_probs"], fresh, rl.rollout_is_config)

    def advantages(self, exp: Experience, timer: StepTimer) -> dict[str, float]:
        """Put the batch's `advantages` in place; returns metrics of the estimate."""
        batch = exp.batch
        with timer("adv"):
            batch["advantages"] = compute_advantages(self.cfg.rl_config.adv_estimator, exp.scores, batch["loss_mask"],
                                                     self.n)
        return {}

    def update(self, step: int, batch: dict[str, torch.Tensor], timer: StepTimer) -> dict[str, float]:
        """Train on the scored batch (streaming: the engines generate meanwhile); returns the update's metrics."""
        from mindrl.trainer.async_rollout import ready

        with timer("update"):
            if self.scheduled is None:
                return actor_metrics(self.group.call("update", batch, phase="update")[0])
            start, pending = time.perf_counter(), self.group.call_async("update", batch)
            self.scheduled.while_updating(pending, ready, step - 1)
            return actor_metrics(self.group.wait(pending, "update", since=start)[0])

    def experience(self, step: int, timer: StepTimer) -> Experience:
        """A scored batch with the log-probs the update needs (several rollout rounds under DAPO)."""
        if self.scheduled is not None:
            return self.scheduled_experience(step, timer)
        rl = self.cfg.rl_config
        accumulator = GroupAccumulator(self.train_groups, self.n, rl.filter_groups_max_batches,
                                       rl.filter_groups_metric) if rl.filter_groups_enable else None
        metrics: dict[str, float] = {}
        rounds: list[ScoreResult] = []  # every round's scores: the reward metrics cover all that was generated
        for attempt in itertools.count():
            prompts = self.loader.next_batch()
            ids, images = [p.ids for p in prompts], images_of(prompts)
            with timer("rollout"):
                result, generated = self.group.call("generate", ids, self.n,
                                                    sampling_for_step(self.sampling, step, attempt), images,
                                                    phase="rollout")[0]
            for phase in RESHARDING_PHASES:
                timer.seconds[phase] = timer.seconds.get(phase, 0.0) + generated.pop(f"timing/{phase}", 0.0)
            add_round(metrics, generated)
            batch = rollout_batch(ids, result, self.n, self.pad_id, images)
            labels = [p.label for p in prompts for _ in range(self.n)]
            pending = self.rewards.submit(self.texts(result.responses), labels, batch, calls_of(batch))
            if accumulator is None:
                break
            rounds.append(self.rewards.collect(pending, timer))
            scores = torch.tensor(rounds[-1].rewards)
            verifier = {k: torch.tensor(v) for k, v in rounds[-1].scores.items()}
            batch.update(scores=scores, **{f"verifier/{k}": v for k, v in verifier.items()})
            if accumulator.add(batch, select_filter_values(rl.filter_groups_metric, scores, verifier)):
                break
        if accumulator is not None:
            batch = accumulator.batch({"tokens": self.pad_id})
            metrics.update(accumulator.metrics())
        self.log_prob_passes(batch, timer)
        if accumulator is None:
            scored = self.rewards.collect(pending, timer)
            metrics.update(scored.metrics)
            scores = torch.tensor(scored.rewards)
            verifier = {k: torch.tensor(v) for k, v in scored.scores.items()}
        else:
            metrics.update(ScoreResult.concatenate(rounds).metrics)
            scores = batch.pop("scores")
            verifier = {k.removeprefix("verifier/"): batch.pop(k) for k in list(batch) if k.startswith("verifier/")}
        return Experience(batch, scores, verifier, metrics)

    def scheduled_experience(self, step: int, timer: StepTimer) -> Experience:
        """The schedule's next batch (generated under one or more earlier versions), scored, with the proximal
        log-probs recomputed by the actor and each token's version."""
        from mindrl.trainer.async_rollout import token_versions

        groups = self.scheduled.batch(step - 1, timer)
        prompts, result, versions = batch_of(groups)
        rows = [self.loader.prompts[g.row] for g in groups]
        images = images_of(rows)
        batch = rollout_batch(prompts, result, self.n, self.pad_id, images)
        batch["token_versions"] = token_versions(versions, batch)
        pending = self.rewards.submit(self.texts(result.responses), [p.label for p in rows for _ in range(self.n)],
                                      batch, calls_of(batch))
        self.log_prob_passes(batch, timer)
        scored = self.rewards.collect(pending, timer)
        return Experience(batch, torch.tensor(scored.rewards), {k: torch.tensor(v) for k, v in scored.scores.items()},
                          dict(scored.metrics))

    def log_prob_passes(self, batch: dict[str, torch.Tensor], timer: StepTimer) -> None:
        from mindrl.workers.group import gather_rows

        rows = rows_of(batch)
        if self.ref_group is not None:  # on its own devices it runs while the actor does the old pass
            start, pending = time.perf_counter(), self.ref_group.call_async("log_probs", rows)
        elif self.cfg.rl_config.uses_reference:
            with timer("reference_model"):
                batch["ref_log_probs"] = gather_rows(self.group.call("log_probs", rows, "reference",
                                                                     phase="reference_model"), self.dp_size)
        if not self.on_policy:
            with timer("old_log_p"):
                batch["old_log_probs"] = gather_rows(self.group.call("log_probs", rows, "actor", phase="old_log_p"),
                                                     self.dp_size)
        if self.ref_group is not None:
            batch["ref_log_probs"] = gather_rows(self.ref_group.wait(pending, "reference_model", since=start),
                                                 self.ref_dp_size)
            timer.seconds["reference_model"] = time.perf_counter() - start

    def texts(self, responses: list[list[int]]) -> list[str]:
        """What the verifiers read: the response up to its end of turn, or a multi-turn response's every turn."""
        text = trajectory_text if self.agent else response_text
        return [text(self.tokenizer, r, self.stop_ids) for r in responses]

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self.tokenizer.eos_token_id if pad is None else pad

    # ---------------------------------------------------------------- validation, checkpoints, export
    def validate(self) -> dict[str, float]:
        """Greedy answers to the test split, scored like training rewards (the reward model's score raw)."""
        greedy = SamplingConfig(max_tokens=self.sampling.max_tokens, top_k=1, logprobs=0, seed=0)
        prompts, images = [p.ids for p in self.test_prompts], images_of(self.test_prompts)
        if self.scheduled is not None and self.scheduled.role is not None:
            result = self.scheduled.generate(prompts, 1, greedy, images)
        else:
            result, _ = self.group.call("generate", prompts, 1, greedy, images, phase="validation")[0]
        batch = rollout_batch(prompts, result, 1, self.pad_id, images)
        pending = self.rewards.submit(self.texts(result.responses), [p.label for p in self.test_prompts], batch,
                                      calls_of(batch))
        scored = self.rewards.collect(pending, training=False)
        summary = rollout_metrics([len(r) for r in result.responses], self.max_response, scored.rewards,
                                  scored.scores)
        summary.update(multi_turn_metrics(batch))
        return {f"validation/{key}": value for key, value in summary.items()}

    def save(self, step: int) -> None:
        self.group.call("save", self.cfg.actor_config.save, step, self.save_extra(step), phase="save")
        self.last_saved = step

    def resume_hint(self) -> str:
        """Where a resume of this run would start, as the stop sentence of mindrl/trainer/nonfinite.py says it."""
        if self.last_saved:
            return f"its last checkpoint (iteration {self.last_saved} in {self.cfg.actor_config.save})"
        return "the start (no checkpoint was saved yet)"

    def save_extra(self, step: int) -> dict[str, Any]:
        """The driver's state a resume needs, saved with the actor's checkpoint."""
        return {"job": self.job, "data": self.loader.state_dict(), "initial_weights": self.start.initial_weights,
                "step": step, "reward_model_stats": self.rewards.stats.state_dict(),
                "skipped_steps": self.skipped.state_dict(),
                **({"schedule": self.scheduled.state_dict()} if self.scheduled is not None else {})}

    def export(self) -> Path | None:
        self.finish_saves()
        return export_hf(self.cfg.actor_config.save, self.cfg.actor_config.tokenizer_name_or_path)

    def finish_saves(self) -> None:
        """The last checkpoint published (an asynchronous save's writes waited for) before anything reads it."""
        self.group.call("finish_saves", phase="save")


def agent_spec(multi_turn: MultiTurnConfig | None, train_path: Path, actor: Any,
               tokenizer: Any) -> AgentSpec | None:
    """The agent loop the ranks build, with the tool turn of the template the data was rendered with."""
    if multi_turn is None:
        return None
    template = run_template(train_path, actor.prompt_type, actor.prompt_type_path)
    if template is None:
        raise ConfigError(f"multi_turn_enable needs the chat template's tool turn, but {train_path} records no "
                          f"template and prompt_type is unset; set megatron_training.prompt_type to the template the "
                          f"data was rendered with (e.g. qwen).")
    spec = AgentSpec(multi_turn, actor.tokenizer_name_or_path, template.tool_turn(tokenizer))
    notice = check_data_announces(train_path, multi_turn)
    if notice:
        say(f"warning: {notice}")
    return spec


def wait_shares(metrics: dict[str, float]) -> dict[str, float]:
    """Each role's idle share of the step: the trainer's waiting for groups, the engines' time not generating."""
    step = max(metrics.get("timing/all", 0.0), 1e-9)
    return {"async/trainer_idle_share": min(1.0, metrics.get("async/trainer_wait_seconds", 0.0) / step),
            "async/rollout_idle_share": max(0.0, 1.0 - metrics.get("rollout/generate_seconds", 0.0) / step)}


def update_nonfinite(metrics: dict[str, float]) -> NonFinite | None:
    """What an update found non-finite (PPO's critic updates before the actor), from its renamed metrics."""
    return skipped_update(metrics, "critic") or skipped_update(metrics, "actor")


def calls_of(batch: dict[str, torch.Tensor]) -> list[int] | None:
    """Each row's tool calls that answered (a malformed call earns no call bonus), for the verifiers that grade
    them; None for a single-turn batch."""
    return batch["tool_calls_ok"].tolist() if "tool_calls_ok" in batch else None


def rows_of(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a forward pass over the batch's rows needs: the tokens, the lengths that let a prompt's samples
    be packed behind one copy of it, a mixture of experts' routes to replay, and a vision-language model's images."""
    keys = ("tokens", "prompt_lengths", "response_lengths", "routes", "pixel_values", "image_grid_thw")
    return {key: batch[key] for key in keys if key in batch}
