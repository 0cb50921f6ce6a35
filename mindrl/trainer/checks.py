"""Rules that span sections: parallel layouts, batch divisibility, colocation, sequence lengths, the
reward model's checkpoint.

Each is a sentence before Ray starts; the same mistakes would otherwise surface as a hang in a
collective, a shape error in the update, or a truncated rollout after the cluster has spun up.
"""

from __future__ import annotations

import importlib.util

from mindrl.algorithms.advantages import GROUP_ESTIMATORS
from mindrl.algorithms.group_filter import TOTAL_SCORE
from mindrl.config import ConfigError, ParallelConfig, validate_parallel
from mindrl.config.parallel import validate_sequence_parallel
from mindrl.models import hf_mapping as hfm
from mindrl.platform import PLATFORMS
from mindrl.rollout.config import VLLM_ROUTES, GenerateConfig, check_megatron_rollout
from mindrl.trainer.grpo_config import TrainerConfig, max_response_length
from mindrl.trainer.megatron import SEQUENCE_PARALLEL_AT_TP1
from mindrl.trainer.reward_model import REWARD_MODEL
from mindrl.trainer.rl import BUDGET_KEYS, RLConfig

#: why no reference runs: its KL weight is off (ray_grpo), or the stage has none (ray_dapo)
_NO_REFERENCE = {False: "init_kl_coef is 0", True: "stage ray_dapo runs none (DAPO's loss has no KL term)"}


def uses_vllm(gen: GenerateConfig) -> bool:
    """Whether the run's engine is vLLM, as generate_config.backend resolves where vLLM is installed (found without
    importing it: the engines import it where they start)."""
    return gen.backend == "vllm" or (gen.backend == "auto" and importlib.util.find_spec("vllm") is not None)


def check_colocation(cfg: TrainerConfig) -> None:
    rl, res = cfg.rl_config, cfg.rl_config.resources
    actor, ref, reward = res["actor_resource"], res["reference_resource"], res["reward_resource"]
    if rl.use_integrated_worker:
        if rl.colocate_actor_ref is False:
            raise ConfigError("use_integrated_worker: true runs the reference inside the actor, which contradicts "
                              "colocate_actor_ref: false; drop one of them.")
        if ref is not None:
            raise ConfigError("rl_config.reference_resource must be unset with use_integrated_worker: true (the "
                              "reference runs inside the actor's processes); remove it or set use_integrated_worker: "
                              "false.")
    if rl.colocate_all_models and rl.colocate_actor_ref is False:
        raise ConfigError("colocate_all_models: true contradicts colocate_actor_ref: false; drop one of them.")
    if cfg.colocate_actor_ref and ref is not None and ref != actor:
        raise ConfigError(f"colocate_actor_ref puts the reference on the actor's devices, but reference_resource "
                          f"({ref}) differs from actor_resource ({actor}); make them equal or remove "
                          f"reference_resource.")
    if rl.colocate_all_models and reward is not None and reward != actor:
        raise ConfigError(f"colocate_all_models puts the reward model on the actor's devices, but reward_resource "
                          f"({reward}) differs from actor_resource ({actor}); make them equal.")
    if not rl.use_integrated_worker and not cfg.colocate_actor_ref and rl.uses_reference and ref is None:
        raise ConfigError("the reference model needs devices: set rl_config.reference_resource, or "
                          "colocate_actor_ref: true, or init_kl_coef: 0 to train without it.")
    if not rl.uses_reference and ref is not None:
        dapo = cfg.stage == "ray_dapo"
        fix = "use stage ray_grpo (cli/train_grpo.py)" if dapo else "set init_kl_coef > 0"
        raise ConfigError(f"rl_config.reference_resource is set but {_NO_REFERENCE[dapo]}, so no reference model runs; "
                          f"remove it or {fix}.")
    if rl.share_backbone and cfg.stage == "ray_dapo":
        raise ConfigError("rl_config.share_backbone makes the LoRA actor's frozen base its reference, but stage "
                          "ray_dapo runs no reference (DAPO's loss has no KL term); remove it or use stage ray_grpo.")
    if rl.share_backbone and not cfg.actor_config.lora.enabled:
        raise ConfigError("rl_config.share_backbone: true makes the reference the actor with its LoRA adapters off, "
                          "but actor_config sets no lora_target_modules; add adapters or turn share_backbone off.")
    if rl.share_backbone and rl.uses_reference and not rl.use_integrated_worker:
        raise ConfigError("rl_config.share_backbone: true makes the actor its own reference (no second model), so no "
                          "reference runs on devices of its own; set use_integrated_worker: true or turn "
                          "share_backbone off.")
    if "reward_config" in cfg.sections_given and reward is None and not rl.colocate_all_models:
        raise ConfigError("reward_config configures a reward-model worker, which runs on rl_config.reward_resource or, "
                          "with colocate_all_models: true, on the actor's devices; set one or remove reward_config.")
    if not rl.rule_reward and cfg.reward_config is None:
        raise ConfigError("no reward at all: rule_reward is false and no reward_resource is set; set "
                          "rule_reward: true (and verifier_function) or a reward model.")


def check_layouts(cfg: TrainerConfig) -> None:
    """Every role's TP/PP against its model and device count, the rollout engine's TP, and a critic in the actor's
    processes in the actor's layout."""
    critic, actor = cfg.critic_config, cfg.actor_config
    def layout(par: ParallelConfig) -> str:
        return f"TP={par.tp} PP={par.pp}" + (f" CP={par.cp}" if par.cp > 1 else "")

    if critic is not None and not cfg.critic_on_own_devices and \
            (critic.parallel.tp, critic.parallel.pp, critic.parallel.cp) != \
            (actor.parallel.tp, actor.parallel.pp, actor.parallel.cp):
        raise ConfigError(f"the critic runs in the actor's processes (no rl_config.critic_resource) and so in its "
                          f"layout, {layout(actor.parallel)}, but critic_config asks {layout(critic.parallel)}; match "
                          f"them or give the critic its own critic_resource.")
    if critic is not None and critic.arch.padded_vocab_size < actor.arch.padded_vocab_size:
        raise ConfigError(f"critic_config's model {critic.arch.name} has {critic.arch.padded_vocab_size} token ids, "
                          f"fewer than the actor's {actor.arch.padded_vocab_size}; the critic reads the actor's "
                          f"samples, so give it the actor's tokenizer and model.")
    for section, role, resource in cfg.roles():
        try:
            validate_parallel(role.arch, role.parallel, world_size=resource.count)
            validate_sequence_parallel(role.arch, role.parallel)
        except ConfigError as err:
            raise ConfigError(f"{section}: {err}") from None
    if cfg.rl_config.prompt_packing is True and not cfg.rl_config.use_remove_padding:
        # the reward model scores plain rows; the critic in the actor's processes packs as the actor does
        # (padding-free micro-batches share prompts under sequence parallelism too)
        packing = [(section, role) for section, role, _ in cfg.roles() if section != "reward_config"]
        if critic is not None and not cfg.critic_on_own_devices:
            packing.append(("critic_config", critic))
        for section, role in packing:
            if role.parallel.sequence_parallel_for(role.arch):
                raise ConfigError(f"rl_config.prompt_packing: true packs a prompt's samples into one row, but "
                                  f"{section} runs sequence-parallel, whose rows are padded to a multiple of TP "
                                  f"instead; set prompt_packing to auto (it then stays off there) or false.")
    cfg.generate_config.check_engine_layout(actor.arch, cfg.rl_config.resources["actor_resource"].count)


def check_rollout(cfg: TrainerConfig) -> None:
    """The policy has an LM head; what vLLM on the actor's devices and the final HF export need."""
    gen, actor = cfg.generate_config, cfg.actor_config
    if actor.arch.has_score_head:
        raise ConfigError(f"actor_config: model {actor.arch.name} has num_labels={actor.arch.num_labels}, a score head "
                          f"that makes it a reward model; a policy samples from an LM head, so remove num_labels.")
    vllm = uses_vllm(gen)
    if gen.rollout_routing_replay and vllm:
        raise ConfigError(VLLM_ROUTES)
    if gen.rollout_routing_replay and cfg.rl_config.prompt_packing is True:
        raise ConfigError("rl_config.prompt_packing: true packs a prompt's samples into one row, but the routes "
                          "generate_config.rollout_routing_replay replays are per sample; set prompt_packing to auto "
                          "(it then stays off) or false.")
    if not vllm and gen.enable_expert_parallel:
        raise ConfigError("generate_config.enable_expert_parallel splits experts over vLLM's ranks, but the rollout "
                          "backend is the Megatron engine, which runs the actor's own expert layout; turn it off.")
    if not vllm:
        try:
            check_megatron_rollout(actor.arch, actor.parallel, gen.rollout_routing_replay)
        except ConfigError as err:
            raise ConfigError(f"actor_config: {err}") from None
    if vllm:
        platform = cfg.rl_config.resources["actor_resource"].platform
        gen.check_vllm_on(actor.arch, PLATFORMS[platform])
    if vllm or actor.save:
        try:
            hfm.check_hf_can_hold(actor.arch, hfm.model_type_hf_of(actor.arch))
        except ConfigError as err:
            reason = str(err).split(";")[0].rstrip(".")
            raise ConfigError(f"actor_config: {reason}, but vLLM rollouts and the HF export after the last step "
                              f"need an HF family to hold it; use such a model, or backend: megatron without "
                              f"save.") from None


def check_batches(cfg: TrainerConfig) -> None:
    rl, actor = cfg.rl_config, cfg.actor_config
    gbs, n = actor.global_batch_size, rl.n_samples_per_prompt
    if rl.adv_estimator in GROUP_ESTIMATORS and n < 2:
        raise ConfigError(f"adv_estimator {rl.adv_estimator} compares the responses of one prompt, so "
                          f"n_samples_per_prompt={n} gives zero advantages; set it to 2 or more.")
    if gbs % rl.mini_batch_size:
        raise ConfigError(f"global_batch_size={gbs} is not a multiple of rl_config.mini_batch_size="
                          f"{rl.mini_batch_size} (both count prompts); make it one.")
    if rl.filter_groups_enable and rl.filter_groups_train_batch_size is not None:
        if rl.filter_groups_train_batch_size % rl.mini_batch_size:
            raise ConfigError(f"filter_groups_train_batch_size={rl.filter_groups_train_batch_size} is not a "
                              f"multiple of mini_batch_size={rl.mini_batch_size}; make it one.")
    trained = {"actor_config": ("mini_batch_size", rl.mini_batch_size)}
    if cfg.critic_config is not None:
        trained["critic_config"] = ("critic_mini_batch_size", rl.critic_mini_batch_size or rl.mini_batch_size)
        if gbs % trained["critic_config"][1]:
            raise ConfigError(f"global_batch_size={gbs} is not a multiple of the critic's mini-batch of "
                              f"{trained['critic_config'][1]} prompts (critic_mini_batch_size, else mini_batch_size); "
                              f"make it one.")
    roles = cfg.roles()
    if cfg.critic_config is not None and not cfg.critic_on_own_devices:
        roles.append(("critic_config", cfg.critic_config, rl.resources["actor_resource"]))
    for section, role, resource in roles:
        dp = resource.count // role.parallel.model_ranks
        if section in trained:
            key, prompts = trained[section]
            samples = prompts * n
            if samples % (dp * role.micro_batch_size):
                raise ConfigError(
                    f"a {section.removesuffix('_config')} mini-batch of {prompts}×{n}={samples} samples does not give "
                    f"each of its {dp} data-parallel ranks whole micro-batches of {section}.micro_batch_size="
                    f"{role.micro_batch_size}; make {key} × n_samples_per_prompt a multiple of "
                    f"{dp * role.micro_batch_size}.")
        batches = [("global_batch_size", gbs)]
        if rl.filter_groups_enable and rl.filter_groups_train_batch_size is not None:
            batches.append(("filter_groups_train_batch_size", rl.filter_groups_train_batch_size))
        for key, prompts in batches:  # every rollout is scored; DAPO's filtered batch is what trains
            if (prompts * n) % dp:
                raise ConfigError(f"{key} × n_samples_per_prompt = {prompts * n} samples do not split over "
                                  f"{section}'s {dp} data-parallel ranks; make it a multiple of {dp}.")
    rollout_dp = rl.resources["actor_resource"].count // cfg.generate_config.infer_tensor_parallel_size
    if gbs % rollout_dp:
        raise ConfigError(f"global_batch_size={gbs} prompts do not split over the {rollout_dp} rollout engines "
                          f"(actor devices / infer_tensor_parallel_size); make it a multiple of {rollout_dp}.")


def check_lengths(cfg: TrainerConfig) -> None:
    rl, gen, actor = cfg.rl_config, cfg.generate_config, cfg.actor_config
    max_tokens = gen.sampling_config.max_tokens
    need = rl.max_prompt_length + max_tokens
    if gen.max_model_len < need:
        raise ConfigError(f"generate_config.max_model_len={gen.max_model_len} is shorter than max_prompt_length + "
                          f"max_tokens = {rl.max_prompt_length} + {max_tokens}; raise it to at least {need}.")
    if gen.max_model_len < actor.seq_length:
        raise ConfigError(f"generate_config.max_model_len={gen.max_model_len} is shorter than seq_length="
                          f"{actor.seq_length}; raise max_model_len or lower seq_length.")
    if rl.max_prompt_length > actor.seq_length:
        raise ConfigError(f"rl_config.max_prompt_length={rl.max_prompt_length} exceeds seq_length="
                          f"{actor.seq_length}, which truncates prompts; lower it or raise seq_length.")
    if gen.max_model_len > actor.arch.max_position_embeddings:
        raise ConfigError(f"generate_config.max_model_len={gen.max_model_len} exceeds max_position_embeddings="
                          f"{actor.arch.max_position_embeddings} of model {actor.arch.name}; lower it.")
    reward = rl.reward
    if reward.overlong_buffer_enable and reward.rollout_max_tokens != max_tokens:
        raise ConfigError(f"rl_config.rollout_max_tokens={reward.rollout_max_tokens} must equal sampling_config."
                          f"max_tokens={max_tokens} when overlong_buffer_enable is true; make them equal.")


def check_packing(cfg: TrainerConfig) -> list[str]:
    """use_remove_padding against the models and megatron_training's packing keys; the notices of budgets that
    the longest sample exceeds (it is then alone in its micro-batch)."""
    rl = cfg.rl_config
    split = [(section, role.parallel.cp) for section, role, _ in cfg.roles() if role.parallel.cp > 1]
    if not rl.use_remove_padding:
        if split:
            raise ConfigError(f"{split[0][0]}.context_parallel_size={split[0][1]} cuts padding-free packed sequences "
                              f"over its ranks; set rl_config.use_remove_padding: true.")
        return []
    if split and rl.use_dynamic_bsz:
        least = 2 * max(cp for _, cp in split)
        for key in rl.budgets_below(least, cfg.reward_config is not None):
            raise ConfigError(f"rl_config.{key}={getattr(rl, key)} is below 2 × context_parallel_size = {least} "
                              f"tokens, so its micro-batches would leave CP ranks without a token of their samples "
                              f"(each sample is cut in 2 × CP chunks); raise it to at least {least}.")
    for section, role, _ in cfg.roles():
        if role.arch.vision is not None:
            raise ConfigError(f"rl_config.use_remove_padding packs text rows, but {section}'s model {role.arch.name} "
                              f"is a vision-language model whose multimodal positions are per padded row (MindSpeed-RL "
                              f"refuses it too); set use_remove_padding: false.")
        if role.reset_attention_mask is False:
            raise ConfigError(f"{section}.reset_attention_mask: false would let packed samples attend to each "
                              f"other, which mindrl does not build (use_remove_padding always restarts attention and "
                              f"positions at each sample); set it to true or remove it.")
    reward = cfg.reward_config is not None
    for key in rl.budgets_below(rl.max_prompt_length, reward):
        raise ConfigError(f"rl_config.{key}={getattr(rl, key)} is below max_prompt_length={rl.max_prompt_length}, "
                          f"but a prompt is never cut between micro-batches; raise it to at least "
                          f"{rl.max_prompt_length}.")
    longest = rl.max_prompt_length + max_response_length(rl, cfg.generate_config)
    return [f"rl_config.{key}={getattr(rl, key)} is below the longest sample this run can make ({longest} tokens: "
            f"max_prompt_length + the response's limit); such a sample is alone in its micro-batch, whose activations "
            f"then follow the sample, not the budget; raise it to {longest} to bound every micro-batch."
            for key in rl.budgets_below(longest, reward)]


def check_multi_turn(cfg: TrainerConfig) -> list[str]:
    """The agent loop's limits against the engine's room, what it cannot be combined with, and its tools: loaded
    (a custom tool's signature checked) and the sandbox started once, here rather than in the first rollout.
    Returns warnings (tools that may hold more memory than the machine has)."""
    rl, gen = cfg.rl_config, cfg.generate_config
    multi_turn = rl.multi_turn(gen.max_model_len)
    if multi_turn is None:
        return []
    total, max_tokens = multi_turn.max_total_response_length, gen.sampling_config.max_tokens
    if total < max_tokens:
        raise ConfigError(f"rl_config.max_total_response_length={total} is below sampling_config.max_tokens="
                          f"{max_tokens}, the budget of one turn; raise it to at least {max_tokens}.")
    if rl.max_prompt_length + total > gen.max_model_len:
        raise ConfigError(f"max_prompt_length + max_total_response_length = {rl.max_prompt_length} + {total} exceeds "
                          f"generate_config.max_model_len={gen.max_model_len}; lower max_total_response_length or "
                          f"raise max_model_len.")
    if gen.rollout_routing_replay:
        raise ConfigError("generate_config.rollout_routing_replay records the engine's routes per turn, which a "
                          "multi-turn response (model and tool turns) does not replay yet; turn one of them off.")
    vllm = uses_vllm(gen)
    if not vllm and cfg.actor_config.parallel.expert_model_parallel_size > 1:
        raise ConfigError("the Megatron-native engine keeps expert-parallel replicas in step within one generate call, "
                          "but multi-turn replicas end after different numbers of turns; use backend: vllm or "
                          "expert_model_parallel_size: 1 with multi_turn_enable.")
    if rl.reward.overlong_buffer_enable:
        raise ConfigError("rl_config.overlong_buffer_enable penalises responses near max_tokens, one turn's budget, "
                          "but a multi-turn response runs to max_total_response_length and counts the tools' tokens; "
                          "turn the overlong penalty off.")
    from mindrl.rollout.agent_loop import check_tools

    warning = check_tools(multi_turn)
    return [warning] if warning else []


def check_async(cfg: TrainerConfig) -> None:
    """What the scheduled rollout (rl_config.rollout_mode, partial_rollout_max_split, rollout_resource) needs and
    what it cannot be combined with yet."""
    rl, gen = cfg.rl_config, cfg.generate_config
    if not rl.scheduled:
        return
    own = rl.resources["rollout_resource"]
    if rl.rollout_mode != "sync" and own is None:
        raise ConfigError(f"rl_config.rollout_mode: {rl.rollout_mode} generates while the actor trains, so the engines "
                          f"need devices of their own; set rl_config.rollout_resource (e.g. {{num_gpus: 8}}).")
    vllm = uses_vllm(gen)
    if own is not None and not vllm:
        raise ConfigError("rl_config.rollout_resource puts the engines on devices of their own, but the "
                          "Megatron-native engine generates with the actor's own model; set generate_config.backend: "
                          "vllm, or remove rollout_resource.")
    if rl.filter_groups_enable:
        raise ConfigError("DAPO's dynamic sampling (filter_groups_enable) repeats the rollout within a step, which the "
                          "scheduled rollout (rollout_mode, partial_rollout_max_split, rollout_resource) does not yet; "
                          "turn one of them off.")
    if rl.trains_critic:
        raise ConfigError("the scheduled rollout (rollout_mode, partial_rollout_max_split, rollout_resource) is "
                          "built for GRPO-family estimators, not PPO's critic yet; use adv_estimator group_norm or "
                          "the synchronous colocated rollout.")
    split, max_tokens = rl.partial_rollout_max_split, gen.sampling_config.max_tokens
    if split > max_tokens:
        raise ConfigError(f"rl_config.partial_rollout_max_split={split} cuts max_tokens={max_tokens} into segments "
                          f"of less than one token; lower it to at most {max_tokens}.")
    if split > 1 and rl.multi_turn_enable:
        raise ConfigError("a multi-turn trajectory is generated whole, not in segments; set partial_rollout_max_split: "
                          "1 with multi_turn_enable.")
    if split > 1 and gen.rollout_routing_replay:
        raise ConfigError("generate_config.rollout_routing_replay records one set of routes per generation, which a "
                          "partial rollout's segments would split; set partial_rollout_max_split: 1.")


def check_rewards(cfg: TrainerConfig) -> None:
    rl = cfg.rl_config
    if rl.rule_reward:
        # the verifier modules load only when rewards are checked
        from mindrl.rewards import get_verifier
        from mindrl.rewards.scorer import fail_scores

        for name in rl.reward.verifier_function:
            get_verifier(name)
        fail_scores(rl.reward)
        if "labels" not in cfg.actor_config.dataset_additional_keys:
            raise ConfigError("rule rewards grade against each prompt's answer, so megatron_training."
                              "dataset_additional_keys must contain 'labels'.")
    verifiers = rl.reward.verifier_function if rl.rule_reward else []
    model = [REWARD_MODEL] if cfg.reward_config is not None else []
    if rl.filter_groups_enable and rl.filter_groups_metric not in [*verifiers, *model, TOTAL_SCORE]:
        raise ConfigError(f"rl_config.filter_groups_metric={rl.filter_groups_metric!r} is not in verifier_function "
                          f"{verifiers}; name one of those verifiers, {TOTAL_SCORE!r} (the weighted total)"
                          f"{' or ' + repr(REWARD_MODEL) if model else ''}.")


def inert_keys(cfg: TrainerConfig) -> list[str]:
    """Keys set away from their default whose enabling key is off: they would do nothing, so each gets a warning
    naming what would enable it (refusing them would turn away MindSpeed-RL files that carry them)."""
    rl, defaults = cfg.rl_config, RLConfig()
    notices = cfg.actor_config.inert_keys()
    others = {section: role for section, role, _ in cfg.roles()[1:]}
    if cfg.critic_config is not None:
        others["critic_config"] = cfg.critic_config
    notices += [f"{section}.{SEQUENCE_PARALLEL_AT_TP1}" for section, role in others.items()
                if role.sequence_parallel_is_inert]
    critic = cfg.critic_config
    if critic is not None and critic.save not in (None, cfg.actor_config.save):
        notices.append(f"critic_config.save={critic.save} has no effect: the critic's checkpoints go to critic/ in "
                       f"the run's save folder (actor_config.save), where a resume finds them.")

    def off(keys: tuple[str, ...], because: str) -> None:
        notices.extend(f"rl_config.{key}={getattr(rl, key)!r} has no effect {because}." for key in keys
                       if getattr(rl, key) != getattr(defaults, key))

    if not rl.filter_groups_enable:
        off(("filter_groups_metric", "filter_groups_max_batches", "filter_groups_train_batch_size"),
            "without filter_groups_enable: true (DAPO's dynamic sampling)")
    if rl.rollout_is == "none":
        off(("rollout_is_threshold",), "with rollout_is: none; set rollout_is to token or sequence to correct for "
                                       "the engine/trainer mismatch")
    if not rl.trains_critic:
        off(("gamma", "lam", "cliprange_value", "critic_warmup", "critic_mini_batch_size", "critic_epochs"),
            "without adv_estimator: gae (PPO with a critic, cli/train_ppo.py)")
    if not rl.use_kl_in_reward:
        off(("kl_target", "kl_horizon"), "without use_kl_in_reward: true (the adaptive KL penalty in the reward)")
    if not rl.uses_reference:
        off(("share_backbone",), f"with {_NO_REFERENCE[False]} (no reference runs)")
    if not rl.multi_turn_enable:
        off(("tool_config_path", "max_tool_calls", "max_parallel_calls", "max_total_response_length",
             "max_tool_response_length", "tool_response_truncate_side", "tool_parser_format"),
            "without multi_turn_enable: true (docs/multi_turn.md)")
    if rl.rollout_mode == "one_step_off_policy" or (rl.rollout_mode == "sync" and rl.partial_rollout_max_split == 1):
        off(("max_staleness",), f"in rollout_mode {rl.rollout_mode}"
                                f"{'' if rl.partial_rollout_max_split > 1 else ' without partial rollout'} (its bound "
                                f"is {rl.staleness_bound} versions)")
    if not rl.scheduled:
        off(("use_decoupled_loss", "behav_imp_weight_cap"), "with the synchronous colocated rollout (every sample "
                                                             "is on-policy); see docs/async_rollout.md")
    if cfg.reward_config is None:
        off(("reward_model_normalize", "reward_model_weight"), "without a reward model (rl_config.reward_resource "
                                                               "or colocate_all_models with reward_config)")
    if not rl.use_dynamic_bsz:
        off(BUDGET_KEYS, "without use_dynamic_bsz: true (token-budget micro-batches, with use_remove_padding; "
            "docs/long_responses.md)")
    notices += [f"{section}.recompute_granularity={role.recompute_granularity} has no effect: the {section[:-7]} "
                f"runs forward only, which keeps no activations to recompute." for section, role in others.items()
                if section in ("ref_config", "reward_config") and role.recompute_granularity is not None]
    return notices
