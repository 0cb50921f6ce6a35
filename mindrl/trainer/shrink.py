"""A trainer recipe shrunk to run on two CPU cores in minutes, its algorithm kept.

A recipe's algorithm lives in its rl_config keys (DAPO's clip-higher and dynamic sampling, PPO's critic,
LoRA's adapters, multi-turn tool use, a mixture of experts, context parallelism); its size lives in the
model, the devices, the lengths and the batch. Shrinking replaces the second kind only: the model keeps its
family's switches (QKV bias, q/k norms, untied embeddings, experts and their routing, multi-latent attention) at
a tiny width, every role gets two CPU ranks, lengths and token budgets scale down, and the batch becomes a few
prompts a step.
A parallel layout that needs more than two ranks becomes the one of its dimensions that shows the feature
on two: context parallelism where the recipe cuts sequences, expert parallelism where it splits experts,
else data parallelism; roles on devices of their own (PPO's critic) share the two, one rank each. A model with
multi-latent attention rolls out on the Megatron engine (vLLM-CPU's does not compute it as the model does). So a
user can try a recipe (MindSpeed-RL's or their own) on a laptop before a cluster, and the tests train
every published recipe this way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mindrl.config.errors import ConfigError

#: the tiny width every shrunk model takes (head_dim 32: vLLM-CPU's attention refuses 16)
TINY_MODEL = {"num_layers": 2, "hidden_size": 128, "ffn_hidden_size": 352, "num_attention_heads": 4,
              "kv_channels": 32, "max_position_embeddings": 1024, "make_vocab_size_divisible_by": 1}
TINY_QUERY_GROUPS = 2
TINY_EXPERTS = {"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 64}
#: multi-latent attention at tiny width, its latent + rotated width DeepSeek-V3's (576: vLLM's MLA kernels' size)
TINY_MLA = {"kv_lora_rank": 512, "qk_head_dim": 32, "qk_pos_emb_head_dim": 64, "v_head_dim": 32}
TINY_QUERY_LATENT = 64
#: the keys of a model that size it (dropped: TINY_MODEL sizes it) or that only a cluster needs
_SIZE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "max_position_embeddings", "padded_vocab_size", "make_vocab_size_divisible_by",
              "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
              "group_query_attention", *TINY_MLA, "q_lora_rank")
#: the section of each stage trained without Ray's RL driver, which holds its devices
STAGE_SECTIONS = {"dpo": "dpo_config", "sft": "sft_config"}
MEGATRON_SECTIONS = ("megatron_training", "actor_config", "ref_config", "reward_config", "critic_config")
#: two CPU ranks a role
RANKS = 2
PROMPT_TOKENS = 160
#: a multi-turn recipe's prompts announce its tools' schemas, a few hundred tokens of the tiny tokenizers
TOOL_PROMPT_TOKENS = 512
RESPONSE_TOKENS = 48
PROMPTS_A_STEP = 4
SAMPLES_A_PROMPT = 4
#: dynamic sampling's rounds a step where the recipe allows any number: a model from random weights may never give
#: an informative group, and the run should end with the trainer's sentence saying so rather than loop
UNLIMITED_ROUNDS = 40


def shrink(data: Mapping[str, Any], tokenizer: str, data_path: str, save: str, vocab_size: int,
           steps: int = 2) -> dict[str, Any]:
    """`data` (a composed trainer recipe: sections → keys, its model inline under `model`) at tiny size, training
    `steps` steps from `data_path`'s prompts with `tokenizer` (of `vocab_size` tokens), writing under `save`; raises
    ConfigError where two ranks cannot hold the recipe's roles and parallelism."""
    out = {section: dict(values) if isinstance(values, Mapping) else values for section, values in data.items()}
    sections = [out[name] for name in MEGATRON_SECTIONS if isinstance(out.get(name), dict)]
    described = [_model_values(out), *sections]
    moe = any(values.get("num_experts") for values in described)
    grouped = any(values.get("num_query_groups") or values.get("group_query_attention") for values in described)
    mla = any(values.get("multi_latent_attention") for values in described)
    out["model"] = {name: _tiny_model(values, vocab_size, moe, grouped, mla)
                    for name, values in (out.get("model") or {}).items()}
    rl = out.get("rl_config") if isinstance(out.get("rl_config"), dict) else {}
    ranks = _ranks_a_role(rl)
    layout = _layout(sections, moe, ranks)
    batch = ((out.get("actor_config") or {}).get("global_batch_size")
             or (out.get("megatron_training") or {}).get("global_batch_size") or PROMPTS_A_STEP)
    for section in sections:
        _tiny_parallel(section, layout)
    training = out.setdefault("megatron_training", {})
    training.update(tokenizer_name_or_path=tokenizer, data_path=data_path, global_batch_size=PROMPTS_A_STEP,
                    seq_length=_prompt_budget(rl), train_iters=steps, save_interval=steps, save=save, bf16=False)
    # the data's template; the recipe's checkpoints, of the full-size model (a shrunk run starts from seeded weights,
    # and a DPO reference is then those weights)
    for key in ("prompt_type", "load", "ref_model", "refer_model_iter"):
        training.pop(key, None)
    stage = training.get("stage")
    if stage in STAGE_SECTIONS:
        section = dict(out.get(STAGE_SECTIONS[stage]) or {})
        section.pop("ref_model", None)
        out[STAGE_SECTIONS[stage]] = {**section, "resource": {"num_cpus": RANKS}}
    for section in ("actor_config", "critic_config", "ref_config", "reward_config"):
        if isinstance(out.get(section), dict):
            for key in ("load", "save", "global_batch_size", "seq_length", "train_iters", "save_interval",
                        "tokenizer_name_or_path", "data_path", "bf16"):
                out[section].pop(key, None)
    if rl:
        out["rl_config"] = _tiny_rl(rl, batch, save, ranks)
    if isinstance(out.get("generate_config"), dict):
        out["generate_config"] = _tiny_engine(out["generate_config"], rl, mla)
    return out


def _model_values(data: Mapping[str, Any]) -> Mapping[str, Any]:
    models = data.get("model") or {}
    return next(iter(models.values()), {}) if isinstance(models, Mapping) else {}


def _tiny_model(values: Mapping[str, Any], vocab_size: int, moe: bool, grouped: bool, mla: bool) -> dict[str, Any]:
    tiny = {key: value for key, value in values.items() if key not in _SIZE_KEYS}
    tiny.update(TINY_MODEL, padded_vocab_size=vocab_size)
    if grouped:  # query groups, as the recipe's model has them; without, every head its own keys and values
        tiny["num_query_groups"] = TINY_QUERY_GROUPS
    if mla:  # its head widths are the MLA sizes; a query latent where it has one
        del tiny["kv_channels"]
        tiny.update(TINY_MLA, **({"q_lora_rank": TINY_QUERY_LATENT} if values.get("q_lora_rank") else {}))
    if moe:
        tiny.update(TINY_EXPERTS)
        if tiny.get("first_k_dense_replace"):  # DeepSeek's and GLM-4.5's dense first layers: one of the two
            tiny["first_k_dense_replace"] = 1
        if tiny.get("moe_router_num_groups"):  # group-limited routing over the tiny experts: two groups, one chosen
            tiny.update(moe_router_num_groups=2, moe_router_group_topk=1)
    return tiny


def _ranks_a_role(rl: Mapping[str, Any]) -> int:
    """The two ranks shared by the roles on devices of their own (the actor, and PPO's critic, say)."""
    roles = sorted({"actor_resource", *(key for key, value in rl.items() if key.endswith("_resource") and value)})
    if len(roles) > RANKS:
        raise ConfigError(f"{', '.join(roles)} put {len(roles)} roles on devices of their own, more than the {RANKS} "
                          f"ranks of a shrunk run; colocate some of them first (rl_config.colocate_actor_ref, "
                          f"colocate_all_models).")
    return RANKS // len(roles) if rl else RANKS


def _layout(sections: list[Mapping[str, Any]], moe: bool, ranks: int) -> dict[str, int]:
    """A role's `ranks` in the recipe's parallelism: CP where it cuts sequences, else EP for experts, else DP."""
    cp = any((section.get("context_parallel_size") or 1) > 1 for section in sections)
    ep = moe and not cp and any((section.get("expert_model_parallel_size") or 1) > 1 for section in sections)
    if (cp or ep) and ranks < 2:
        raise ConfigError(f"the recipe's {'context' if cp else 'expert'} parallelism needs two ranks a role, but its "
                          f"roles on devices of their own leave one each in a shrunk run; colocate them first.")
    return {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "context_parallel_size": ranks if cp else 1, "expert_model_parallel_size": ranks if ep else 1}


def _tiny_parallel(section: dict[str, Any], layout: Mapping[str, int]) -> None:
    # noop_layers pad layers to the pipeline stages a shrunk run has not; swap_optimizer and moe_tp_extend_ep stay
    for key in ("num_layer_list", "noop_layers", "sequence_parallel", "num_layers_per_virtual_pipeline_stage",
                "micro_batch_size", *_SIZE_KEYS):
        section.pop(key, None)
    for key, size in layout.items():
        if key in section or size > 1:
            section[key] = size
    if "recompute_num_layers" in section:
        section["recompute_num_layers"] = min(section["recompute_num_layers"], TINY_MODEL["num_layers"])


def _scaled(value: int, was: int, now: int) -> int:
    """`value` of a batch of `was` prompts in one of `now`, at least 1 and at most `now`."""
    return max(1, min(now, value * now // max(was, 1)))


def _tiny_rl(rl: dict[str, Any], batch: int, save: str, ranks: int) -> dict[str, Any]:
    longest = _prompt_budget(rl) + _response_budget(rl)
    rl.update(n_samples_per_prompt=min(rl.get("n_samples_per_prompt") or SAMPLES_A_PROMPT, SAMPLES_A_PROMPT),
              max_prompt_length=_prompt_budget(rl), tensorboard_dir=f"{save}/tensorboard")
    for key in ("mini_batch_size", "filter_groups_train_batch_size"):
        if key in rl:
            rl[key] = _scaled(rl[key], batch, PROMPTS_A_STEP)
    for key in [k for k in rl if k.endswith("_resource") and rl[k] is not None]:
        rl[key] = {"num_cpus": ranks}
    for key in [k for k in rl if k.endswith("max_packing_token_size")]:
        rl[key] = 2 * longest
    for key in [k for k in rl if k.endswith("dynamic_max_batch_size")]:
        rl[key] = max(rl[key] or 1, 2)
    if rl.get("filter_groups_enable") and (rl.get("filter_groups_max_batches") or 0) <= 0:
        rl["filter_groups_max_batches"] = UNLIMITED_ROUNDS  # a tiny model's groups may never be informative
    if "rollout_max_tokens" in rl or rl.get("overlong_buffer_enable"):
        rl["rollout_max_tokens"] = RESPONSE_TOKENS
        rl["overlong_buffer"] = RESPONSE_TOKENS // 4
    if rl.get("multi_turn_enable"):
        rl["max_total_response_length"] = 2 * RESPONSE_TOKENS
        rl["max_tool_response_length"] = RESPONSE_TOKENS
        rl["max_tool_calls"] = min(rl.get("max_tool_calls") or 1, 1)
    return rl


def _prompt_budget(rl: Mapping[str, Any]) -> int:
    return TOOL_PROMPT_TOKENS if rl.get("multi_turn_enable") else PROMPT_TOKENS


def _response_budget(rl: Mapping[str, Any]) -> int:
    return 2 * RESPONSE_TOKENS if rl.get("multi_turn_enable") else RESPONSE_TOKENS


def _tiny_engine(gen: dict[str, Any], rl: Mapping[str, Any], mla: bool) -> dict[str, Any]:
    longest = _prompt_budget(rl) + _response_budget(rl)
    if mla:  # vLLM-CPU's multi-latent attention scores other log-probs than the model (mindrl/platform/cpu.py)
        gen["backend"] = "megatron"
    for key in ("gpu_memory_utilization", "dtype", "tokenizer_name_or_path"):
        gen.pop(key, None)
    gen.update(max_num_seqs=min(gen.get("max_num_seqs") or longest, longest), infer_tensor_parallel_size=1,
               infer_pipeline_parallel_size=1, infer_expert_parallel_size=1, enable_expert_parallel=False,
               max_model_len=longest, max_num_batched_tokens=longest)
    sampling = dict(gen.get("sampling_config") or {})
    sampling["max_tokens"] = RESPONSE_TOKENS
    gen["sampling_config"] = sampling
    return gen
