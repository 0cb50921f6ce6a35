"""The GRPO trainer's sections, resolved: role sections merged over megatron_training, each with its architecture.

Each section checks its own keys as it is built; the rules that span sections live in
mindrl.trainer.checks, and mindrl.trainer.config runs them after building.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from mindrl.algorithms.policy_loss import LossConfig
from mindrl.config import ConfigError
from mindrl.config.keys import KeyNote, Keys, normalise
from mindrl.config.profiler import ProfilerConfig
from mindrl.config.resources import RoleResource
from mindrl.rollout.config import GenerateConfig
from mindrl.trainer.dapo_stage import DAPO, dapo_rl_config
from mindrl.trainer.megatron import MegatronConfig
from mindrl.trainer.profiling import run_profiler
from mindrl.trainer.reward_model import reward_model_role
from mindrl.trainer.rl import RLConfig

if TYPE_CHECKING:
    from mindrl.workers.megatron_worker import ActorConfig

SECTIONS = ("model", "megatron_training", "actor_config", "ref_config", "reward_config", "critic_config", "rl_config",
            "generate_config", "profiler_config")


@dataclass(frozen=True)
class TrainerConfig:
    """Role sections are merged over megatron_training and carry their resolved architecture.

    With the integrated worker `ref_config` is the actor's (as in MindSpeed-RL): the reference
    runs inside the actor's processes and must share its layout.
    """

    megatron_training: MegatronConfig
    actor_config: MegatronConfig
    ref_config: MegatronConfig
    reward_config: MegatronConfig | None
    rl_config: RLConfig
    generate_config: GenerateConfig
    loss: LossConfig
    #: PPO's critic (adv_estimator: gae): its architecture is the actor's with a one-output value head
    critic_config: MegatronConfig | None = None
    #: the top-level sections the file (after overrides) actually gave
    sections_given: frozenset[str] = field(default_factory=frozenset)
    #: keys set to something other than their default that have no effect here, each with what would enable it;
    #: the trainer warns once per key at start (MindSpeed-RL's files carry several at their defaults: no noise)
    notices: tuple[str, ...] = ()
    #: ray_grpo, ray_dapo (critic-free, no KL, no reference) or ray_ppo (a critic): which command trains it
    stage: str = "ray_grpo"
    #: profiler_config's integrated role: the phases and steps traced (docs/profiling.md)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)

    @property
    def save_dir(self) -> str | None:
        """Where the run writes its checkpoints, metrics and log (the actor's `save`)."""
        return self.actor_config.save

    @property
    def colocate_actor_ref(self) -> bool:
        rl = self.rl_config
        return bool(rl.use_integrated_worker or rl.colocate_actor_ref or rl.colocate_all_models)

    def roles(self) -> list[tuple[str, MegatronConfig, RoleResource]]:
        """(section, settings, devices) of every Megatron worker group that runs."""
        res = self.rl_config.resources
        out = [("actor_config", self.actor_config, res["actor_resource"])]
        if self.rl_config.uses_reference and not self.rl_config.use_integrated_worker:
            out.append(("ref_config", self.ref_config, res["reference_resource"] or res["actor_resource"]))
        if self.reward_config is not None:
            out.append(("reward_config", self.reward_config, res["reward_resource"] or res["actor_resource"]))
        if self.critic_on_own_devices:
            out.append(("critic_config", self.critic_config, res["critic_resource"]))
        return out

    @property
    def critic_on_own_devices(self) -> bool:
        return self.critic_config is not None and self.rl_config.resources["critic_resource"] is not None

    def device_groups(self) -> list[tuple[str, RoleResource]]:
        """Disjoint sets of devices: colocated roles share one."""
        names = {"actor_config": "actor", "ref_config": "reference", "reward_config": "reward",
                 "critic_config": "critic"}
        groups: list[tuple[str, RoleResource]] = []
        for section, _, resource in self.roles():
            shared = (section == "ref_config" and self.colocate_actor_ref) or \
                     (section == "reward_config" and self.rl_config.colocate_all_models)
            if shared:
                groups[0] = (f"{groups[0][0]}+{names[section]}", groups[0][1])
            else:
                groups.append((names[section], resource))
        rollout = self.rl_config.resources.get("rollout_resource")
        if rollout is not None:
            groups.append(("rollout", rollout))
        return groups

    def devices_held(self) -> int:
        """Every device the run holds: each disjoint group of device_groups() once (colocated roles, and the rollout
        engines without a rollout_resource, run on the actor's devices); the throughputs divide by it."""
        return sum(resource.count for _, resource in self.device_groups())

    @property
    def train_batch_size(self) -> int:
        """Prompts per update: DAPO fills its batch to filter_groups_train_batch_size informative groups."""
        rl = self.rl_config
        return (rl.filter_groups_train_batch_size if rl.filter_groups_enable else None) or \
            self.actor_config.global_batch_size

    def actor_update_config(self) -> ActorConfig:
        """The actor worker's settings (mini-batch in samples, sampling temperature for log-probs)."""
        rl = self.rl_config
        steps = rl.epochs * (self.train_batch_size // rl.mini_batch_size)
        return self.actor_config.actor_config(rl.mini_batch_size * rl.n_samples_per_prompt, steps, epochs=rl.epochs,
                                              shuffle_mini_batch=rl.shuffle_mini_batch, loss=self.loss,
                                              temperature=self.generate_config.sampling_config.temperature,
                                              prompt_packing=rl.packing_mode, batching=rl.batching("update"))

    def critic_update_config(self) -> ActorConfig:
        """The critic worker's settings: its own optimizer keys (critic_config), mini-batches and epochs
        (critic_mini_batch_size, critic_epochs; the actor's by default)."""
        rl = self.rl_config
        mini, epochs = rl.critic_mini_batch_size or rl.mini_batch_size, rl.critic_epochs or rl.epochs
        steps = epochs * (self.train_batch_size // mini)
        return self.critic_config.actor_config(mini * rl.n_samples_per_prompt, steps, epochs=epochs,
                                               shuffle_mini_batch=rl.shuffle_mini_batch,
                                               prompt_packing=rl.packing_mode, batching=rl.batching("critic"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], notes: list[KeyNote] | None = None,
                  command: str | None = None) -> TrainerConfig:
        """Build every section and check each on its own (mindrl.trainer.checks then checks them together);
        `notes` collects unsupported keys instead of raising; `command` is the stage of the command loading the
        file (cli/train_dapo.py's ray_dapo), which a file without a `stage` takes."""
        keys = Keys(notes)
        data = dict(normalise(data))
        for key in list(data):
            if key not in SECTIONS:
                keys.unknown("", key, SECTIONS)
                data.pop(key)
        for key in SECTIONS:
            if not isinstance(data.get(key) or {}, Mapping):
                raise ConfigError(f"{key} must be a mapping of keys, got {data[key]!r}.")
        models = data.get("model") or {}
        base = normalise(data.get("megatron_training") or {})
        rl = RLConfig.from_dict(data.get("rl_config") or {}, keys)
        stage = "ray_ppo" if rl.trains_critic else "ray_dapo" if DAPO in (base.get("stage"), command) else "ray_grpo"
        dapo_notices = []
        if stage == DAPO:
            rl, dapo_notices = dapo_rl_config(rl, normalise(data.get("rl_config") or {}))
        role = {"megatron_training": MegatronConfig.from_dict("megatron_training", base, models, keys, stage)}
        wanted = ["actor_config", "ref_config"]
        if "reward_config" in data or rl.resources["reward_resource"] is not None:
            wanted.append("reward_config")
        if rl.trains_critic:
            wanted.append("critic_config")
        elif data.get("critic_config") is not None or rl.resources["critic_resource"] is not None:
            raise ConfigError(f"critic_config / critic_resource configure PPO's critic, which adv_estimator "
                              f"{rl.adv_estimator} does not use; remove them or set adv_estimator: gae "
                              f"(cli/train_ppo.py).")
        for s in wanted:
            own = normalise(data.get(s) or {})
            # a megatron_training key was reported there already; report only the role's own keys
            role[s] = MegatronConfig.from_dict(s, {**base, **own}, models, Keys(notes, only=set(own)), stage)
        notices = []
        if rl.use_integrated_worker:
            notices = _integrated_reference_notices(normalise(data.get("ref_config") or {}), role["ref_config"],
                                                    role["actor_config"])
            role["ref_config"] = role["actor_config"]  # the reference lives in the actor's processes, in its layout
        reward = role.get("reward_config")
        if reward is not None:
            reward = reward_model_role(reward, role["actor_config"])
        gen = GenerateConfig.from_dict(data.get("generate_config") or {}, keys)
        profiler, profiler_notices = run_profiler(data.get("profiler_config"), keys, rl, role["actor_config"])
        loss = rl.loss_config(max_response_length(rl, gen))
        critic = role.get("critic_config")
        if critic is not None:
            critic = replace(critic, arch=replace(critic.arch, num_labels=1))
        return cls(role["megatron_training"], role["actor_config"], role["ref_config"], reward, rl, gen, loss, critic,
                   frozenset(k for k in data if data[k] is not None), (*dapo_notices, *notices, *profiler_notices),
                   stage, profiler)


def max_response_length(rl: RLConfig, gen: GenerateConfig) -> int:
    """The longest response a rollout gives: one turn's max_tokens, or a multi-turn trajectory's whole budget."""
    multi_turn = rl.multi_turn(gen.max_model_len)
    return multi_turn.max_total_response_length if multi_turn else gen.sampling_config.max_tokens


def _integrated_reference_notices(own: Mapping[str, Any], ref: MegatronConfig, actor: MegatronConfig) -> list[str]:
    """ref_config's keys that the integrated worker ignores (the reference is the actor's twin in its processes)
    where they ask for something else than the actor has."""
    notices = []
    for key, value in own.items():
        ref_value, actor_value = (getattr(role, key, getattr(role.arch, key, None)) for role in (ref, actor))
        if ref_value != actor_value:
            notices.append(f"ref_config.{key}={value!r} has no effect with use_integrated_worker: true (the reference "
                           f"runs in the actor's processes with actor_config.{key}={actor_value!r}); set "
                           f"use_integrated_worker: false to give the reference its own settings.")
    return notices
