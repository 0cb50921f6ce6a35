"""`megatron_training` and the role sections merged over it (`actor_config`, `ref_config`, `reward_config`,
`critic_config`).

As in MindSpeed-RL a role section is `{**megatron_training, **role}` and may name its
architecture with `model:` (an entry of the defaults list) or override architecture keys
(`num_layers: 96`). Unlike MindSpeed-RL, `bf16: false` (fp32) and `bf16: auto` (bf16 where the device runs
it fast) are allowed, and kernel or feature keys mindrl does not build are refused by name instead of
passed on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mindrl.checkpoint import files
from mindrl.config import ConfigError, ModelArch, ParallelConfig
from mindrl.config.keys import Keys, normalise
from mindrl.config.lora import LoraConfig
from mindrl.config.parallel import CP_ALGORITHMS, parse_layer_list, without_noop_layers
from mindrl.config.recompute import Recompute
from mindrl.config.values import check_types, positive

if TYPE_CHECKING:
    from mindrl.workers.megatron_worker import ActorConfig

#: `stage` → the command that trains it
STAGES = {"ray_grpo": "cli/train_grpo.py", "ray_dapo": "cli/train_dapo.py", "ray_ppo": "cli/train_ppo.py",
          "sft": "cli/train_sft.py", "dpo": "cli/train_dpo.py"}
#: the stages of the Ray RL drivers; only ray_ppo trains a critic
RL_STAGES = ("ray_grpo", "ray_dapo", "ray_ppo")
# ActorConfig checks these too, but importing it loads megatron-core (seconds on a small box);
# a config must be judged before that, so its value rules (decay style, warm-up, the scheduler switches) are
# repeated here.
LR_DECAY_STYLES = ("constant", "cosine", "linear")
SEQUENCE_PARALLEL_AT_TP1 = ("sequence_parallel=true has no effect at tensor_model_parallel_size 1 (it cuts "
                            "activations over the TP ranks; Megatron turns it off there too).")
#: MindSpeed-RL's attention_mask_type values: both are the causal per-sample attention mindrl computes
ATTENTION_MASK_TYPES = ("causal", "general")
_ARCH_KEYS = frozenset(f.name for f in dataclasses.fields(ModelArch)) - {"name"}


@dataclass(frozen=True)
class MegatronConfig:
    #: which entry of the defaults list's `model` group this role builds
    model: str | None = None
    #: which trainer the file is for (ray_grpo, ray_ppo, sft or dpo); unset means the one loading it
    stage: str | None = None
    tokenizer_name_or_path: str | None = None
    #: folder of cli/preprocess_data.py output (train.parquet, test.parquet) or one parquet / jsonl file
    data_path: str | None = None
    dataset_additional_keys: list[str] = dataclasses.field(default_factory=lambda: ["labels"])
    #: the template the prompts were rendered with, for its stop words; unset: the one the data records
    prompt_type: str | None = None
    prompt_type_path: str | None = None
    no_shuffle: bool = False
    global_batch_size: int | None = None
    micro_batch_size: int = 1
    seq_length: int | None = None
    train_iters: int | None = None
    save_interval: int = 0
    save: str | None = None
    load: str | None = None
    #: the iteration of `load` a run resumes from instead of the one its tracker names (Megatron-LM's --ckpt-step):
    #: an earlier, complete checkpoint where the latest is damaged
    ckpt_step: int | None = None
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_save_optim: bool = False
    no_save_rng: bool = False
    #: the format checkpoints are saved in (Megatron-LM's key): torch, Megatron's per-rank files, or torch_dist,
    #: megatron-core's distributed checkpoint, which resumes at another TP / PP / EP / DP layout
    ckpt_format: str = "torch"
    #: torch_dist only: checkpoints are written in the background while training goes on (Megatron-LM's key)
    async_save: bool = False
    #: MindSpeed's key: the optimizer state (Adam's moments, fp32 master weights) stays in host memory except
    #: during the optimizer step and a checkpoint's save or load, freeing it from the device for the forward and
    #: backward passes and the rollout (docs/memory_plan.md)
    swap_optimizer: bool = False
    #: MindSpeed's moe_tp_extend_ep (whole experts over the TP × EP ranks); no effect: each expert is cut over the
    #: TP ranks, megatron-core's layout, with the same share of expert weights per rank (docs/moe.md)
    moe_tp_extend_ep: bool = False
    #: load a checkpoint in whichever format its files are, not only ckpt_format's (Megatron-LM's key)
    auto_detect_ckpt_format: bool = False
    seed: int = 1234
    #: true: bf16 weights (fp32 master weights in the optimizer); false: fp32; auto: bf16 where the device runs it
    #: faster than fp32 (decided by the ranks, mindrl.platform.precision)
    bf16: bool | str = False
    use_distributed_optimizer: bool = True
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_decay_style: str = "constant"
    lr_warmup_fraction: float = 0.0
    lr_decay_iters: int | None = None
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layer_list: str | list[int] | None = None
    #: a mixture of experts' expert-parallel size (its experts spread over the role's data-parallel ranks)
    expert_model_parallel_size: int = 1
    #: the experts' TP cut; only TP itself (null) is built
    expert_tensor_parallel_size: int | None = None
    #: Megatron's sequence parallelism under TP > 1 (norms and residual adds cut along the sequence over the TP
    #: ranks); null: on exactly for a mixture of experts, which megatron-core trains under TP only so
    sequence_parallel: bool | None = None
    #: ranks each packed sequence is cut over (docs/context_parallel.md); needs rl_config.use_remove_padding
    context_parallel_size: int = 1
    #: ulysses_cp_algo (all-to-all to head shards; heads and key-value groups per TP rank divisible by CP) or
    #: megatron_cp_algo (ring attention, no head condition)
    context_parallel_algo: str = "ulysses_cp_algo"
    #: MindSpeed-RL's mask kind for its attention kernels: causal (the kernel builds the mask) or general (a mask
    #: tensor); mindrl always attends each sample causally to itself (and a response to its shared prompt), which
    #: both name
    attention_mask_type: str = "causal"
    #: a vision-language model: train the language model only, the vision tower (merger included) kept as loaded
    freeze_vision_tower: bool = False
    #: on resume, the config's LR / weight-decay schedule replaces the checkpoint's from its step on (Megatron's key)
    override_opt_param_scheduler: bool = False
    #: on resume, the checkpoint's schedule goes on without the warning given where it differs (Megatron's key)
    use_checkpoint_opt_param_scheduler: bool = False
    #: LoRA adapters on these linear layers (linear_qkv, linear_proj, linear_fc1, linear_fc2); the base stays frozen
    lora_target_modules: list[str] | None = None
    #: the adapters' rank
    lora_r: int = 8
    #: the adapters' scale is lora_alpha / lora_r
    lora_alpha: float = 16.0
    #: checkpoints hold the adapters (and their optimizer state) only, with a digest of the base they go back on
    lora_ckpt_filter: bool = False
    #: activation recompute in the trained roles' backward (actor, critic, SFT, DPO): full (whole layers) or
    #: selective (the attention core); forward-only passes keep nothing to recompute (docs/long_responses.md)
    recompute_granularity: str | None = None
    #: full recompute: uniform (groups of recompute_num_layers layers) or block (the first recompute_num_layers
    #: layers of each pipeline stage)
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    #: MindSpeed's recompute of the MLP activation alone: not built (refused when true)
    recompute_activation_function: bool = False
    #: Megatron's attention reset at sample boundaries; packed micro-batches (rl_config.use_remove_padding) always
    #: do so, so only false with them is refused; null and true mean the same
    reset_attention_mask: bool | None = None
    #: MindSpeed-RL's key for not padding rows to seq_length: mindrl never does (rows are padded to the batch's
    #: longest, packed micro-batches not at all), so either value is accepted
    no_pad_to_seq_lengths: bool | None = None
    #: the resolved architecture (model yaml entry + this section's architecture keys); not a key
    arch: ModelArch | None = dataclasses.field(default=None, compare=False)

    def check(self, section: str, stage: str = "ray_grpo") -> None:
        check_types(section, self)
        positive(section, self, "global_batch_size", "micro_batch_size", "seq_length", "train_iters",
                 "lr_decay_iters", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size", "context_parallel_size")
        if self.context_parallel_algo not in CP_ALGORITHMS:
            raise ConfigError(f"{section}.context_parallel_algo must be one of {', '.join(CP_ALGORITHMS)} "
                              f"(all-to-all or ring attention), got {self.context_parallel_algo!r}.")
        if self.attention_mask_type not in ATTENTION_MASK_TYPES:
            raise ConfigError(f"{section}.attention_mask_type must be causal or general (both mean each sample attends "
                              f"causally to itself, as mindrl always does), got {self.attention_mask_type!r}.")
        positive(section, self, "save_interval", allow_zero=True)
        if self.stage in RL_STAGES and (self.stage == "ray_ppo") != (stage == "ray_ppo"):
            raise ConfigError(f"{section}.stage={self.stage!r} but rl_config.adv_estimator is "
                              f"{'gae, which trains a critic (ray_ppo)' if stage == 'ray_ppo' else 'critic-free'}; "
                              f"set stage: {stage} or pick the estimator of {self.stage} "
                              f"({'gae' if self.stage == 'ray_ppo' else 'group_norm'}).")
        if self.stage is not None and self.stage != stage:
            known = f"; {self.stage} runs with {STAGES[self.stage]}" if self.stage in STAGES else ""
            raise ConfigError(f"{section}.stage={self.stage!r} is not what {STAGES[stage]} trains; use {stage}{known}.")
        for key in ("global_batch_size", "seq_length", "train_iters"):
            if getattr(self, key) is None:
                raise ConfigError(f"{section}.{key} is required; set it in megatron_training.")
        if isinstance(self.bf16, str) and self.bf16 != "auto":
            raise ConfigError(f"{section}.bf16 must be true, false or auto, got {self.bf16!r}.")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError(f"{section}.lr_decay_style must be one of {', '.join(LR_DECAY_STYLES)}, got "
                              f"{self.lr_decay_style!r}.")
        if not 0.0 <= self.lr_warmup_fraction < 1.0:
            raise ConfigError(f"{section}.lr_warmup_fraction must be in [0, 1), got {self.lr_warmup_fraction}.")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError(f"{section}.override_opt_param_scheduler and {section}."
                              f"use_checkpoint_opt_param_scheduler are both true, but a resume takes either the "
                              f"config's LR schedule or the checkpoint's; set one of them to false.")
        for key in ("lr", "min_lr", "weight_decay", "clip_grad"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{section}.{key} must be >= 0, got {getattr(self, key)}.")
        if self.min_lr > self.lr:
            raise ConfigError(f"{section}.min_lr={self.min_lr} is above lr={self.lr}; the schedule decays from lr "
                              f"to min_lr, so lower min_lr.")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"{section}.{key} must be in [0, 1), got {getattr(self, key)}.")
        if self.num_layer_list is not None:
            object.__setattr__(self, "num_layer_list", ",".join(map(str, parse_layer_list(self.num_layer_list))))
        self.lora.check(section)
        if self.lora.enabled and self.arch is not None and self.arch.multi_latent_attention:
            raise ConfigError(f"{section}.lora_target_modules: mindrl puts no adapters on multi-latent attention's "
                              f"projections (model {self.arch.name}) yet; train it without LoRA (remove "
                              f"lora_target_modules).")
        files.check_ckpt_format(self.ckpt_format, self.async_save, section, self.swap_optimizer)
        full = self.recompute_granularity == "full" and self.arch is not None
        self.recompute.check(section, max(self.parallel.layers_per_stage(self.arch)) if full else None)
        if self.recompute_activation_function:
            raise ConfigError(f"{section}.recompute_activation_function: true asks for MindSpeed's recompute of the "
                              f"MLP activation alone, which mindrl does not build; use recompute_granularity: "
                              f"selective (the attention core) or full (whole layers), or remove the key.")
        if self.freeze_vision_tower and self.arch is not None and self.arch.vision is None:
            raise ConfigError(f"{section}.freeze_vision_tower is set but model {self.arch.name} has no vision tower; "
                              f"remove it.")

    @property
    def lora(self) -> LoraConfig:
        return LoraConfig(tuple(self.lora_target_modules or ()), self.lora_r, self.lora_alpha, self.lora_ckpt_filter)

    @property
    def recompute(self) -> Recompute:
        return Recompute(self.recompute_granularity, self.recompute_method, self.recompute_num_layers)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                              self.num_layer_list, self.expert_model_parallel_size, self.expert_tensor_parallel_size,
                              self.sequence_parallel, self.context_parallel_size, self.context_parallel_algo)

    def actor_config(self, mini_batch_size: int, steps_per_iteration: int = 1, rows_per_example: int = 1,
                     **update: Any) -> ActorConfig:
        """The worker's optimiser/update settings (batch sizes in rows: `rows_per_example` per example counted by
        mini_batch_size and micro_batch_size, 2 for DPO's pairs; the LR schedule in iterations, each
        `steps_per_iteration` optimizer steps), with `update`'s RL keys (epochs, shuffle_mini_batch, temperature,
        loss); ActorConfig validates them."""
        from mindrl.workers.megatron_worker import ActorConfig  # megatron-core loads only when a worker needs it

        return ActorConfig(lr=self.lr, min_lr=self.min_lr, lr_decay_style=self.lr_decay_style,
                           lr_warmup_fraction=self.lr_warmup_fraction, steps_per_iteration=steps_per_iteration,
                           lr_decay_iters=self.lr_decay_iters or self.train_iters, weight_decay=self.weight_decay,
                           clip_grad=self.clip_grad, adam_beta1=self.adam_beta1, adam_beta2=self.adam_beta2,
                           mini_batch_size=mini_batch_size * rows_per_example,
                           micro_batch_size=self.micro_batch_size * rows_per_example,
                           seed=self.seed, freeze_vision_tower=self.freeze_vision_tower,
                           override_opt_param_scheduler=self.override_opt_param_scheduler,
                           use_checkpoint_opt_param_scheduler=self.use_checkpoint_opt_param_scheduler,
                           lora=self.lora, ckpt_format=self.ckpt_format, async_save=self.async_save,
                           swap_optimizer=self.swap_optimizer,
                           recompute=self.recompute, **update)

    def check_full_checkpoints(self, section: str) -> None:
        """The trainers always train with the distributed optimizer; a key asking otherwise is refused."""
        if not self.use_distributed_optimizer:
            raise ConfigError(f"{section}.use_distributed_optimizer: false is not supported by the trainer (it always "
                              f"shards the optimizer state over the data-parallel ranks); set it to true.")

    def inert_keys(self) -> list[str]:
        """Keys set here that do nothing because the key enabling them is not (a warning each, not an error)."""
        notices = [f"{key}: true has no effect: the trainers' checkpoints always hold the optimizer and RNG state, so "
                   f"that a resume continues exactly (docs/checkpoints.md)." for key in ("no_save_optim", "no_save_rng")
                   if getattr(self, key)]
        if self.save is None and self.save_interval:
            notices.append(f"save_interval={self.save_interval} has no effect without save; set save to write "
                           f"checkpoints every {self.save_interval} steps.")
        if self.sequence_parallel_is_inert:
            notices.append(SEQUENCE_PARALLEL_AT_TP1)
        if self.moe_tp_extend_ep:
            notices.append("moe_tp_extend_ep: true has no effect: mindrl cuts each expert over the tensor-parallel "
                           "ranks (megatron-core's layout) instead of giving each rank whole experts, so each rank "
                           "holds the same share of the expert weights of the same model, in narrower matmuls "
                           "(docs/moe.md).")
        if self.load is None and self.ckpt_step is not None:
            notices.append(f"ckpt_step={self.ckpt_step} has no effect without load; set load to the checkpoint "
                           f"folder it picks an iteration of.")
        return notices

    @property
    def sequence_parallel_is_inert(self) -> bool:
        """`sequence_parallel: true` at TP = 1: Megatron turns it off (there are no TP ranks to cut over)."""
        return bool(self.sequence_parallel) and self.tensor_model_parallel_size == 1

    def saves_at(self, step: int) -> bool:
        """Whether a checkpoint is written after `step`: every save_interval steps and at the last one."""
        return bool(self.save) and (step == self.train_iters or bool(self.save_interval and
                                                                    step % self.save_interval == 0))

    @classmethod
    def from_dict(cls, section: str, values: Mapping[str, Any], models: Mapping[str, Any],
                  keys: Keys, stage: str = "ray_grpo") -> MegatronConfig:
        values = normalise(values)
        noop_layers = values.pop("noop_layers", None)
        fields = {f.name for f in dataclasses.fields(cls)} - {"arch"}
        own = {k: v for k, v in values.items() if k in fields}
        arch_values = {k: v for k, v in values.items() if k not in fields}
        name = own.get("model")
        if name is None and len(models) == 1:
            name = own["model"] = next(iter(models))
        if name not in models:
            known = ", ".join(models) or "none"
            raise ConfigError(f"{section}.model={name!r} names no entry of the defaults list's model group "
                              f"(loaded: {known}); add it under `defaults: - model:` or fix the name.")
        base = dict(models[name])
        overrides = {}
        for key, value in arch_values.items():
            if key in _ARCH_KEYS or _accepted_by_model_yaml(name, base, key, value):
                overrides[key] = value
            else:
                keys.unknown(section, key, fields | _ARCH_KEYS)
        if noop_layers not in (None, "", []):
            _drop_noop_layers(section, noop_layers, own, overrides, base)
        cfg = cls(**own, arch=ModelArch.from_dict(name, {**base, **overrides}))
        cfg.check(section, stage)
        return cfg


def _drop_noop_layers(section: str, noop_layers: Any, own: dict[str, Any], overrides: dict[str, Any],
                      base: Mapping[str, Any]) -> None:
    """MindSpeed-LLM's `noop_layers` (layers doing nothing, padding num_layers to fill the pipeline stages) as the
    model's real num_layers and a num_layer_list with fewer layers on their stages: the same model, without
    running identity layers."""
    if own.get("num_layer_list") not in (None, "", []):
        raise ConfigError(f"{section} sets both noop_layers and num_layer_list, two ways of sizing the pipeline "
                          f"stages; keep one.")
    total = overrides.get("num_layers", base.get("num_layers"))
    if not isinstance(total, int):
        raise ConfigError(f"{section}.noop_layers needs the model's num_layers (the no-op layers counted in); set it.")
    pp = own.get("pipeline_model_parallel_size", 1)
    if pp == 1:  # a section without stages (megatron_training, whose roles set them): the real layers only
        overrides["num_layers"] = total - len(set(parse_layer_list(noop_layers, "noop_layers")))
        return
    overrides["num_layers"], counts = without_noop_layers(noop_layers, total, pp)
    own["num_layer_list"] = ",".join(map(str, counts))


def _accepted_by_model_yaml(name: str, base: Mapping[str, Any], key: str, value: Any) -> bool:
    """Model yamls accept a few keys with no effect (e.g. use_mcore_models); so does a role section."""
    try:
        ModelArch.from_dict(name, {**base, key: value})
    except ConfigError:
        return False
    return True
