"""The PPO driver: GRPO's loop with a learned critic (`adv_estimator: gae`, cli/train_ppo.py).

One step: rollout → rewards, reference and old log-prob passes (as GRPO's) → the critic's values of
the batch → token-level rewards (the outcome score at each response's last token, minus the KL
penalty where `use_kl_in_reward`, its coefficient fixed or adaptive) → GAE advantages and returns →
the critic's update on the returns → the actor's update (skipped for the first `critic_warmup`
steps, while the critic learns what the starting policy's states are worth).

The critic lives in the actor's processes, in its layout, offloaded with it during rollouts (no
`critic_resource`), or on devices of its own in its own layout. Its checkpoints are written under
`critic/` in the run's `save` folder, before the actor's — whose tracker marks the step complete — and
resume at the actor's iteration.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from mindrl.algorithms.gae import explained_variance, gae_advantages
from mindrl.algorithms.kl import KLController, kl_divergence, kl_penalized_rewards
from mindrl.checkpoint import files
from mindrl.checkpoint import megatron as mg
from mindrl.config import ConfigError
from mindrl.console import say
from mindrl.trainer.grpo import Experience, GRPOTrainer, rows_of
from mindrl.trainer.grpo_config import TrainerConfig
from mindrl.trainer.metrics import StepTimer
from mindrl.trainer.nonfinite import skipped_update
from mindrl.trainer.start import JOB_PPO

#: the critic's checkpoints, under the run's `save` folder
CRITIC_DIR = "critic"
#: what the critic's update reports, under verl's / MindSpeed-RL's names
CRITIC_NAMES = {"vf_loss": "critic/vf_loss", "vf_clipfrac": "critic/vf_clipfrac", "vpred_mean": "critic/vpred_mean",
                "grad_norm": "critic/grad_norm", "lr": "critic/lr", "prompt_packed": "critic/prompt_packed",
                "skipped": "critic/skipped", "nonfinite_loss": "critic/nonfinite_loss"}


class PPOTrainer(GRPOTrainer):
    job = JOB_PPO

    def __init__(self, cfg: TrainerConfig) -> None:
        rl = cfg.rl_config
        super().__init__(cfg)
        if rl.use_kl_in_reward:  # the penalty reads the old log-probs, so the update cannot provide them itself
            self.on_policy = False
        self.kl_ctrl = KLController(rl.kl_ctrl_type, rl.init_kl_coef, rl.kl_target, rl.kl_horizon)
        self.critic_weights = self._critic_start()
        self.critic_group = None

    def _critic_start(self) -> str | None:
        """The checkpoint the critic starts from, checked here before any worker starts."""
        from mindrl.workers.critic_worker import start_arch

        critic = self.cfg.critic_config
        if self.start.resume is not None:
            root = Path(self.start.resume) / CRITIC_DIR
            if not (root / mg.iteration_dir_name(self.start.iteration)).is_dir():
                raise ConfigError(f"{self.start.resume} iteration {self.start.iteration} holds no critic state "
                                  f"({root}); resume a PPO run's checkpoint, or set finetune: true to start over.")
            return None
        root = critic.load or self.start.initial_weights
        if root is None:
            return None
        try:
            files.check_checkpoint(root, mg.read_tracker(root), start_arch(root, critic.arch), critic.parallel)
        except (OSError, ConfigError) as err:
            raise ConfigError(f"the critic cannot start from {root}: {err}") from None
        return root

    def _critic_spec(self) -> Any:
        from mindrl.workers.ray_ranks import CriticSpec

        cfg, start = self.cfg, self.start
        critic = cfg.critic_config
        resume = str(Path(start.resume) / CRITIC_DIR) if start.resume else None
        # the critic's save is published before the actor's starts (its tracker marks a step whole): synchronous
        update = dataclasses.replace(cfg.critic_update_config(), async_save=False)
        return CriticSpec(critic.arch, critic.parallel, update,
                          cfg.rl_config.value_loss_config(self.max_response), critic.bf16, self.critic_weights,
                          resume, start.iteration if resume else None, start.bf16,
                          load_optim=not critic.no_load_optim, load_rng=not critic.no_load_rng)

    def _spec(self) -> Any:
        from dataclasses import replace

        spec = super()._spec()
        return spec if self.cfg.critic_on_own_devices else replace(spec, critic=self._critic_spec())

    def setup(self) -> None:
        super().setup()
        if self.cfg.critic_on_own_devices:
            from mindrl.workers.group import COLLECTIVE_TIMEOUT_S, WorkerGroup
            from mindrl.workers.ray_ranks import CriticRank

            rl = self.cfg.rl_config
            self.critic_group = WorkerGroup("critic", CriticRank, rl.resources["critic_resource"],
                                            phase_timeout_s=rl.phase_timeout)
            host, port = self.critic_group.rendezvous(COLLECTIVE_TIMEOUT_S)
            setup = self.critic_group.call("setup", host, port, self._critic_spec(), COLLECTIVE_TIMEOUT_S)[0]
            self.critic_dp_size = setup["dp_size"]
            where = f"its own {self.critic_group.world_size} ranks ({setup['precision'].line})"
        else:
            self.critic_group, self.critic_dp_size = self.group, self.dp_size
            where = "the actor's ranks, in its layout"
        start = f"iteration {self.start.iteration}" if self.start.resume else self.critic_weights or "random weights"
        say(f"critic on {where}, from {start}")
        if self.start.resume and "kl_ctrl" in self.start.extra:
            self.kl_ctrl.load_state_dict(self.start.extra["kl_ctrl"])

    def worker_groups(self) -> list[Any]:
        own = [self.critic_group] if self.critic_group is not self.group else []
        return [*super().worker_groups(), *own]

    def close(self) -> None:
        if self.critic_group is not None and self.critic_group is not self.group:
            self.critic_group.kill()
        super().close()

    # ---------------------------------------------------------------- the step's PPO parts
    def advantages(self, exp: Experience, timer: StepTimer) -> dict[str, float]:
        from mindrl.workers.group import gather_rows

        rl, batch = self.cfg.rl_config, exp.batch
        mask = batch["loss_mask"].float()
        with timer("values"):
            values = gather_rows(self.critic_group.call("values", rows_of(batch), phase="values"),
                                 self.critic_dp_size) * mask
        metrics: dict[str, float] = {}
        with timer("adv"):
            kl, coef = torch.zeros_like(mask), self.kl_ctrl.value
            if rl.use_kl_in_reward:
                kl = kl_divergence(batch["old_log_probs"], batch["ref_log_probs"], rl.kl_penalty) * mask
                current = (kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()
                metrics.update({"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": coef})
                self.kl_ctrl.update(current, n_steps=mask.shape[0])
            token_rewards = kl_penalized_rewards(exp.scores.float(), kl, mask, coef)
            batch["advantages"], batch["returns"] = gae_advantages(token_rewards, values, mask, rl.gamma, rl.lam)
        batch["values"] = values
        inside = mask.bool()
        metrics.update({"critic/values_mean": values[inside].mean().item(),
                        "critic/returns_mean": batch["returns"][inside].mean().item(),
                        "critic/vf_explained_var": explained_variance(batch["returns"], values, mask)})
        return metrics

    def update(self, step: int, batch: dict[str, torch.Tensor], timer: StepTimer) -> dict[str, float]:
        critic_batch = {key: batch.pop(key) for key in ("values", "returns")}
        critic_batch.update(rows_of(batch), loss_mask=batch["loss_mask"])
        with timer("update_critic"):
            critic = self.critic_group.call("update_critic", critic_batch, phase="update_critic")[0]
        metrics = {CRITIC_NAMES[key]: float(value) for key, value in critic.items() if key in CRITIC_NAMES}
        # a critic step skipped for a non-finite number skips the rest of the step (mindrl/trainer/nonfinite.py)
        if step <= self.cfg.rl_config.critic_warmup or skipped_update(metrics, "critic"):
            metrics["actor/updated"] = 0.0
            return metrics
        if not self.cfg.loss.use_kl_loss:
            batch.pop("ref_log_probs", None)
        metrics.update(super().update(step, batch, timer))
        metrics["actor/updated"] = 1.0
        return metrics

    def finish_saves(self) -> None:
        self.critic_group.call("finish_critic_saves", phase="save")
        super().finish_saves()

    def save(self, step: int) -> None:
        self.critic_group.call("save_critic", str(Path(self.cfg.actor_config.save) / CRITIC_DIR), step,
                               {"job": self.job, "role": "critic", "step": step}, phase="save")
        super().save(step)

    def save_extra(self, step: int) -> dict[str, Any]:
        return {**super().save_extra(step), "kl_ctrl": self.kl_ctrl.state_dict()}
