"""`rl_config`: algorithm, rewards, roles' resources and colocation, logging and trackers (MindSpeed-RL names).

Batch sizes follow MindSpeed-RL's units: `mini_batch_size` counts prompts (× n_samples_per_prompt
inside). Deliberate differences: `kl_ctrl_type: adaptive` is refused without `use_kl_in_reward` (the
only place an adaptive coefficient moves, in MindSpeed-RL too), clip-higher and token-level loss work in
GRPO too (MindSpeed-RL's GRPO ignores them), unknown verifier names are errors, and resources may be
`num_gpus` or `num_cpus` besides `num_npus`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mindrl.algorithms.advantages import CRITIC_ESTIMATORS, check_estimator
from mindrl.algorithms.decoupled import check_cap
from mindrl.algorithms.kl import KL_ESTIMATORS, kl_ceiling
from mindrl.algorithms.policy_loss import LossConfig
from mindrl.algorithms.rollout_is import DEFAULT_THRESHOLD, RolloutISConfig
from mindrl.algorithms.value_loss import ValueLossConfig
from mindrl.config import ConfigError
from mindrl.config.batching import Batching
from mindrl.config.keys import Keys, normalise
from mindrl.config.resources import RoleResource
from mindrl.config.reward import RewardConfig
from mindrl.config.values import check_types, positive
from mindrl.rollout.config import MultiTurnConfig
from mindrl.trainer.reward_model import NORMALISATIONS
from mindrl.trainer.tracking import TrackingKeys

_REWARD_KEYS = tuple(f.name for f in dataclasses.fields(RewardConfig))
_RESOURCE_KEYS = ("actor_resource", "reference_resource", "reward_resource", "critic_resource", "rollout_resource")
#: sync: generate, then train (today's step); one_step_off_policy: batch k+1 generates while batch k trains (verl's
#: name); streaming: the engines generate without pause, the trainer takes finished groups (AReaL's, NeMo-RL's async)
ROLLOUT_MODES = ("sync", "one_step_off_policy", "streaming")
KL_CONTROLLERS = ("fixed", "adaptive")
# MindSpeed-RL's token_level_loss is a coarser name for two loss_agg_modes.
_AGG_OF_TOKEN_LEVEL = {True: "token-mean", False: "seq-mean-token-mean"}
#: the token budgets and row caps of use_dynamic_bsz
BUDGET_KEYS = ("ref_max_packing_token_size", "actor_max_packing_token_size", "update_max_packing_token_size",
                "max_packing_token_size", "dynamic_max_batch_size", "ref_dynamic_max_batch_size",
                "actor_dynamic_max_batch_size", "update_dynamic_max_batch_size")


@dataclass(frozen=True)
class RLConfig(TrackingKeys):
    use_integrated_worker: bool = True
    #: the reference runs on the actor's devices (implied by use_integrated_worker); null = derived
    colocate_actor_ref: bool | None = None
    #: actor, reference and reward model share the same devices; null = false
    colocate_all_models: bool | None = None
    actor_resource: dict | None = None
    reference_resource: dict | None = None
    reward_resource: dict | None = None
    #: the PPO critic's own devices; unset: it runs in the actor's processes, in the actor's layout
    critic_resource: dict | None = None
    #: the rollout engines' own devices (vLLM); unset: they run in the actor's processes (colocated, the default)
    rollout_resource: dict | None = None
    n_samples_per_prompt: int = 1
    mini_batch_size: int = 1
    epochs: int = 1
    shuffle_mini_batch: bool = False
    max_prompt_length: int = 512
    adv_estimator: str = "group_norm"
    #: GAE's discount and trace decay (adv_estimator: gae)
    gamma: float = 1.0
    lam: float = 0.95
    #: how far one batch may move the critic's value of a token (PPO's value clip)
    cliprange_value: float = 0.5
    #: PPO: the critic alone trains for this many steps before the actor's first update
    critic_warmup: int = 0
    #: prompts per critic optimizer step and passes over the batch (null: mini_batch_size, epochs)
    critic_mini_batch_size: int | None = None
    critic_epochs: int | None = None
    clip_ratio: float = 0.2
    clip_higher_enable: bool = False
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = None
    #: ppo: token-level clipped ratios; gspo: one clipped ratio per response (Qwen3's MoE RL loss)
    policy_loss: str = "ppo"
    loss_agg_mode: str | None = None
    token_level_loss: bool | None = None
    entropy_coeff: float = 0.0
    kl_penalty: str = "low_var_kl"
    kl_ctrl_type: str = "fixed"
    init_kl_coef: float = 0.01
    #: PPO: the KL to the reference is a per-token penalty in the reward (coefficient init_kl_coef, moved by the
    #: adaptive controller) instead of a loss term
    use_kl_in_reward: bool = False
    #: the adaptive controller's target for the mean per-token KL, and its horizon in samples (verl's numbers:
    #: MindSpeed-RL's 100 / 1000 feed the same mean per-token KL, which low_var_kl never lets above 10)
    kl_target: float = 0.1
    kl_horizon: int = 10000
    actor_forward_micro_batch_size: int | None = None
    ref_forward_micro_batch_size: int | None = None
    #: auto | true | false: the actor and reference see a prompt's samples packed behind one copy of it
    #: (auto: where that costs fewer FLOPs; mindrl/models/prompt_packing.py)
    prompt_packing: bool | str = "auto"
    #: every Megatron pass packs each micro-batch's rows into one sequence without padding, each sample attending only
    #: to itself (mindrl/models/micro_batches.py, docs/long_responses.md)
    use_remove_padding: bool = False
    #: with use_remove_padding: micro-batches are cut by a token budget (the keys below) instead of a row count
    use_dynamic_bsz: bool = False
    #: the token budget of a micro-batch in every pass whose own key below is unset (the critic's and the reward
    #: model's always)
    max_packing_token_size: int = 4096
    ref_max_packing_token_size: int | None = None
    actor_max_packing_token_size: int | None = None
    update_max_packing_token_size: int | None = None
    #: at most this many rows in a budgeted micro-batch, in every pass whose own key below is unset; null: no cap
    dynamic_max_batch_size: int | None = None
    ref_dynamic_max_batch_size: int | None = None
    actor_dynamic_max_batch_size: int | None = None
    update_dynamic_max_batch_size: int | None = None
    #: with use_remove_padding: each data-parallel rank gets rows of about the same forward FLOPs (its tokens and
    #: their attention pairs) instead of a contiguous share; results come back in the batch's order
    use_dp_batch_balance: bool = False
    rule_reward: bool = True
    #: weight of the reward model's (normalised) score in each response's reward
    reward_model_weight: float = 1.0
    #: none | running | group: how the reward model's scores are normalised before weighting
    reward_model_normalize: str = "none"
    num_cpus_for_local_task: float = 1.0
    filter_groups_enable: bool = False
    filter_groups_metric: str = "acc"
    filter_groups_max_batches: int = 10
    filter_groups_train_batch_size: int | None = None
    rollout_is: str = "none"
    rollout_is_threshold: float = DEFAULT_THRESHOLD
    test_interval: int = 0
    #: steps in a row that a NaN or inf may skip (mindrl/trainer/nonfinite.py); one more stops the run, so 0 stops
    #: it at the first
    max_nonfinite_steps: int = 3
    #: seconds to wait for a running cluster (RAY_ADDRESS) to offer the roles' devices before giving up
    resource_wait_timeout: float = 600.0
    #: seconds one phase of a step (rollout with its weight sync, scoring, a log-prob pass, an update, a save) may
    #: take before the driver names the ranks that have not answered and stops the run; 0: no limit
    phase_timeout: float = 3600.0
    #: one device's memory (GiB) for the memory plan (mindrl/trainer/memory_plan.py); null: its kind's in
    #: DEVICE_MEMORY_GIB (NPU 64, GPU 80), a CPU rank's share of this machine's
    device_memory_gib: float | None = None
    #: rollouts are trajectories: the model calls tools between turns (docs/multi_turn.md)
    multi_turn_enable: bool = False
    tool_config_path: str | None = None
    max_tool_calls: int = 8
    max_parallel_calls: int = 4
    #: null: what the engine leaves after the longest prompt (generate_config.max_model_len − max_prompt_length)
    max_total_response_length: int | None = None
    max_tool_response_length: int = 1024
    tool_response_truncate_side: str = "middle"
    tool_parser_format: str = "hermes"
    #: asynchronous rollout (docs/async_rollout.md): sync | one_step_off_policy | streaming
    rollout_mode: str = "sync"
    #: streaming (and partial rollout): a group whose oldest token is more than this many policy versions behind the
    #: update is never trained on (AReaL's max_head_offpolicyness)
    max_staleness: int = 1
    #: partial rollout: a response is generated in up to this many segments of max_tokens / N tokens, continued under
    #: the newer weights of later rounds (MindSpeed-RL's key)
    partial_rollout_max_split: int = 1
    #: off-policy samples: the PPO ratio against the actor's log-probs recomputed before the update (the proximal
    #: policy), each token's loss weighted by π_proximal / π_behaviour (AReaL's decoupled PPO)
    use_decoupled_loss: bool = True
    #: decoupled PPO: tokens whose weight π_proximal / π_behaviour exceeds this are left out (null: none)
    behav_imp_weight_cap: float | None = None
    #: LoRA: the reference is the actor with its adapters off (no second model; needs actor_config.lora_target_modules)
    share_backbone: bool = False
    #: a private cluster (no RAY_ADDRESS) serves Ray's dashboard (needs `pip install "ray[default]"`)
    include_dashboard: bool = False
    use_tensorboard: bool = False
    tensorboard_dir: str = "runs/tensorboard"
    #: verifier_function, verifier_weight, … (mindrl.config.reward), validated there
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    resources: dict[str, RoleResource | None] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], keys: Keys) -> RLConfig:
        values = normalise(values)
        own_fields = {f.name for f in dataclasses.fields(cls)} - {"reward", "resources"}
        reward = {k: values.pop(k) for k in _REWARD_KEYS if k in values}
        own = keys.split("rl_config", values, own_fields | set(_REWARD_KEYS))
        cfg = cls(**own)
        cfg._check()
        try:
            reward_cfg = RewardConfig(**reward)
        except ConfigError as err:
            raise ConfigError(f"rl_config: {err}") from None
        object.__setattr__(cfg, "reward", reward_cfg)
        object.__setattr__(cfg, "resources", {
            key: None if getattr(cfg, key) is None else RoleResource.from_dict(f"rl_config.{key}", getattr(cfg, key))
            for key in _RESOURCE_KEYS})
        if cfg.resources["actor_resource"] is None:
            raise ConfigError("rl_config.actor_resource is required, e.g. {num_gpus: 8} (the total over all nodes).")
        return cfg

    def _check(self) -> None:
        check_types("rl_config", self)
        positive("rl_config", self, "n_samples_per_prompt", "mini_batch_size", "epochs", "max_prompt_length",
                 "actor_forward_micro_batch_size", "ref_forward_micro_batch_size", "filter_groups_train_batch_size",
                 "critic_mini_batch_size", "critic_epochs", "kl_horizon")
        positive("rl_config", self, "test_interval", "resource_wait_timeout", "critic_warmup", "max_nonfinite_steps",
                 "phase_timeout",
                 allow_zero=True)
        if self.device_memory_gib is not None and self.device_memory_gib <= 0:
            raise ConfigError(f"rl_config.device_memory_gib must be a positive number of GiB or null (the device "
                              f"kind's), got {self.device_memory_gib}.")
        check_estimator(self.adv_estimator)
        KL_ESTIMATORS.get(self.kl_penalty)
        if self.kl_ctrl_type not in KL_CONTROLLERS:
            raise ConfigError(f"rl_config.kl_ctrl_type must be fixed or adaptive, got {self.kl_ctrl_type!r}.")
        if self.kl_ctrl_type == "adaptive" and not self.use_kl_in_reward:
            raise ConfigError("rl_config.kl_ctrl_type: adaptive moves the KL penalty in the reward, which only "
                              "use_kl_in_reward: true (PPO) has; the KL loss's weight is the fixed init_kl_coef, so "
                              "use fixed or set use_kl_in_reward: true.")
        if self.use_kl_in_reward and self.adv_estimator not in CRITIC_ESTIMATORS:
            raise ConfigError(f"rl_config.use_kl_in_reward puts the KL in token-level rewards, which only "
                              f"adv_estimator gae reads ({self.adv_estimator} takes one score per response); set "
                              f"adv_estimator: gae or use the KL loss (use_kl_in_reward: false).")
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"rl_config.gamma and lam must lie in [0, 1], got gamma={self.gamma}, lam={self.lam}.")
        for key in ("cliprange_value", "kl_target"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"rl_config.{key} must be positive, got {getattr(self, key)}.")
        if self.kl_ctrl_type == "adaptive" and self.kl_target >= kl_ceiling(self.kl_penalty):
            raise ConfigError(f"rl_config.kl_target={self.kl_target} is never reached: the adaptive controller "
                              f"compares it with the mean per-token {self.kl_penalty} KL, which is at most "
                              f"{kl_ceiling(self.kl_penalty):g}, so the coefficient would only shrink; set a "
                              f"kl_target below that (verl's default is 0.1).")
        if self.init_kl_coef < 0:
            raise ConfigError(f"rl_config.init_kl_coef must be >= 0 (0 turns the KL loss off), got "
                              f"{self.init_kl_coef}.")
        try:
            RolloutISConfig(self.rollout_is, self.rollout_is_threshold)
        except ConfigError as err:
            raise ConfigError(f"rl_config: {err}") from None
        if not self.clip_higher_enable and (self.clip_ratio_low is not None or self.clip_ratio_high is not None):
            raise ConfigError("rl_config.clip_ratio_low / clip_ratio_high only act with clip_higher_enable: true; "
                              "set it or remove them.")
        if self.clip_higher_enable and (self.clip_ratio_low is None or self.clip_ratio_high is None):
            raise ConfigError("rl_config.clip_higher_enable: true needs both clip_ratio_low and clip_ratio_high.")
        implied = _AGG_OF_TOKEN_LEVEL.get(self.token_level_loss)
        if implied and self.loss_agg_mode not in (None, implied):
            raise ConfigError(f"rl_config.token_level_loss={self.token_level_loss} means loss_agg_mode {implied} "
                              f"but loss_agg_mode is {self.loss_agg_mode}; keep only one of the two keys.")
        if self.reward_model_normalize not in NORMALISATIONS:
            raise ConfigError(f"rl_config.reward_model_normalize must be one of {', '.join(NORMALISATIONS)}, got "
                              f"{self.reward_model_normalize!r}.")
        if self.prompt_packing not in (True, False, "auto"):
            raise ConfigError(f"rl_config.prompt_packing must be auto, true or false, got {self.prompt_packing!r}.")
        if self.rollout_mode not in ROLLOUT_MODES:
            raise ConfigError(f"rl_config.rollout_mode must be one of {', '.join(ROLLOUT_MODES)}, got "
                              f"{self.rollout_mode!r}.")
        positive("rl_config", self, "partial_rollout_max_split", *BUDGET_KEYS)
        try:
            self.batching("update")
        except ConfigError as err:
            raise ConfigError(f"rl_config.{err}") from None
        positive("rl_config", self, "max_staleness", allow_zero=True)
        try:
            check_cap(self.behav_imp_weight_cap)
        except ConfigError as err:
            raise ConfigError(f"rl_config.{err}") from None
        if self.num_cpus_for_local_task <= 0:
            raise ConfigError(f"rl_config.num_cpus_for_local_task must be positive, got "
                              f"{self.num_cpus_for_local_task}.")
        self.check_tracking("rl_config")

    def multi_turn(self, max_model_len: int) -> MultiTurnConfig | None:
        """The agent loop's limits, None for single-turn rollouts."""
        if not self.multi_turn_enable:
            return None
        total = self.max_total_response_length
        return MultiTurnConfig(self.max_tool_calls, self.max_parallel_calls,
                               max_model_len - self.max_prompt_length if total is None else total,
                               self.max_tool_response_length, self.tool_response_truncate_side,
                               self.tool_parser_format, self.tool_config_path)

    @property
    def scheduled(self) -> bool:
        """The rollout runs through mindrl/trainer/async_rollout.py: off the actor's devices, ahead of the update,
        or in segments; otherwise the step is the synchronous one."""
        return (self.rollout_mode != "sync" or self.partial_rollout_max_split > 1
                or self.resources.get("rollout_resource") is not None)

    @property
    def staleness_bound(self) -> int:
        """Versions a trained token may lag the update: none in sync mode (unless split), one in one-step mode."""
        if self.rollout_mode == "one_step_off_policy":
            return 1
        if self.rollout_mode == "sync" and self.partial_rollout_max_split == 1:
            return 0
        return self.max_staleness

    @property
    def rollout_is_config(self) -> RolloutISConfig:
        return RolloutISConfig(self.rollout_is, self.rollout_is_threshold)

    def loss_config(self, max_tokens: int) -> LossConfig:
        """The actor loss; Dr. GRPO's constant length is the rollout's max_tokens."""
        # GSPO averages each response's tokens, then the responses (as the paper and verl do)
        default = "seq-mean-token-mean" if self.policy_loss == "gspo" else "token-mean"
        mode = self.loss_agg_mode or _AGG_OF_TOKEN_LEVEL.get(self.token_level_loss, default)
        try:
            return LossConfig(clip_ratio=self.clip_ratio, clip_ratio_low=self.clip_ratio_low,
                              clip_ratio_high=self.clip_ratio_high, clip_ratio_c=self.clip_ratio_c,
                              policy_loss=self.policy_loss,
                              loss_agg_mode=mode, use_kl_loss=self.init_kl_coef > 0 and not self.use_kl_in_reward,
                              kl_coef=self.init_kl_coef,
                              kl_loss_type=self.kl_penalty, entropy_coeff=self.entropy_coeff,
                              loss_norm_length=max_tokens if mode == "seq-mean-token-sum-norm" else None)
        except ConfigError as err:
            raise ConfigError(f"rl_config: {err}") from None

    def value_loss_config(self, max_tokens: int) -> ValueLossConfig:
        """The critic's loss, aggregated as the actor's is."""
        policy = self.loss_config(max_tokens)
        return ValueLossConfig(self.cliprange_value, policy.loss_agg_mode, policy.loss_norm_length)

    @property
    def trains_critic(self) -> bool:
        return self.adv_estimator in CRITIC_ESTIMATORS

    def batching(self, role: str) -> Batching:
        """How the `role` pass (ref, actor, update, critic or reward) cuts its rows: padding-free packing, and its
        token budget and row cap (its own keys, else max_packing_token_size and dynamic_max_batch_size); Batching
        refuses what the keys cannot mean together."""
        tokens = rows = None
        if self.use_dynamic_bsz:
            tokens = getattr(self, f"{role}_max_packing_token_size", None) or self.max_packing_token_size
            rows = getattr(self, f"{role}_dynamic_max_batch_size", None) or self.dynamic_max_batch_size
        return Batching(self.use_remove_padding, tokens, rows, self.use_dp_batch_balance)

    def budgets_below(self, longest: int, reward_model: bool = False) -> list[str]:
        """The budget keys of the passes that run (the reward model's where there is one) whose budget `longest`
        tokens do not fit."""
        if not self.use_dynamic_bsz:
            return []
        roles = ("ref", "actor", "update") + (("critic",) if self.trains_critic else ()) + \
            (("reward",) if reward_model else ())
        keys = [f"{role}_max_packing_token_size" if getattr(self, f"{role}_max_packing_token_size", None)
                else "max_packing_token_size" for role in roles if self.batching(role).max_tokens < longest]
        return list(dict.fromkeys(keys))

    @property
    def packing_mode(self) -> str:
        """prompt_packing as the workers name it: auto, on or off."""
        return {True: "on", False: "off"}.get(self.prompt_packing, "auto")

    @property
    def uses_reference(self) -> bool:
        return self.init_kl_coef > 0
