"""Trainer configs: every shipped one loads, overrides work, each mistake is one quick sentence."""

import dataclasses
import os
import re
import sys
import time
from pathlib import Path

import pytest
import yaml

from mindrl.config import ConfigError, load_model_arch
from mindrl.config.batching import Batching
from mindrl.config.resources import Cluster
from mindrl.rollout.config import GenerateConfig
from mindrl.trainer.config import (
    TRAINER_CONFIGS_DIR,
    check_resources,
    load_mindspeed_config,
    load_trainer_config,
    trainer_loader,
)
from mindrl.trainer.dpo_config import load_dpo_config
from mindrl.trainer.megatron import MegatronConfig
from tests import jobs

os.environ.setdefault("OMP_NUM_THREADS", "1")

REFERENCE = Path(__file__).resolve().parents[2] / "shared/reference/mindspeed_rl/configs"
SHIPPED = sorted(p.stem for p in TRAINER_CONFIGS_DIR.glob("*.yaml"))
# A cluster big enough for every shipped config (the real-cluster ones cannot fit this machine).
BIG = {"NPU": 256, "GPU": 8, "CPU": 2}  # grpo_deepseek_v3: 256 NPUs


def test_the_expected_configs_ship():
    assert {"grpo_qwen25_7b", "grpo_qwen25_32b", "grpo_llama3_8b", "grpo_tiny_cpu", "grpo_small_cpu", "ppo_tiny_cpu",
            "ppo_qwen25_32b"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_loads_and_validates(name):
    cfg = trainer_loader(jobs.stage_of(name))(name)
    assert cfg.actor_config.arch.name == cfg.actor_config.model
    assert cfg.rl_config.n_samples_per_prompt >= 2
    check_resources(cfg, Cluster(BIG))
    rl = cfg.rl_config
    assert cfg.actor_update_config().mini_batch_size == rl.mini_batch_size * rl.n_samples_per_prompt


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the CPU configs take two cores")
@pytest.mark.parametrize("name", ["grpo_tiny_cpu", "grpo_small_cpu", "ppo_tiny_cpu"])
def test_cpu_configs_fit_this_machine(name):
    cfg = load_trainer_config(name)
    assert cfg.rl_config.resources["actor_resource"].kind == "CPU"
    check_resources(cfg)


def test_small_model_has_the_promised_shape():
    arch = load_trainer_config("grpo_small_cpu").actor_config.arch
    per_layer = (arch.hidden_size * (arch.hidden_size + 2 * arch.query_groups * arch.head_dim)  # qkv
                 + (arch.hidden_size + 2 * arch.query_groups * arch.head_dim)  # qkv bias
                 + arch.hidden_size * arch.hidden_size  # proj
                 + 3 * arch.hidden_size * arch.ffn_hidden_size + 2 * arch.hidden_size)
    total = arch.num_layers * per_layer + arch.padded_vocab_size * arch.hidden_size + arch.hidden_size
    assert (arch.num_layers, arch.num_attention_heads, arch.query_groups, arch.padded_vocab_size) == (8, 8, 4, 2048)
    assert arch.tied_embeddings and arch.add_qkv_bias and arch.norm_epsilon == 1e-6 and arch.rotary_base == 1e6
    assert round(total / 1e6, 1) == 24.7


def test_command_line_overrides_change_values():
    cfg = load_trainer_config("grpo_tiny_cpu", ["rl_config.n_samples_per_prompt=8", "actor_config.lr=3e-5",
                                                "generate_config.sampling_config.temperature=0.7",
                                                "+rl_config.rollout_is=token"])
    assert cfg.rl_config.n_samples_per_prompt == 8
    assert cfg.actor_config.lr == 3e-5 and cfg.megatron_training.lr == 1e-6
    assert cfg.generate_config.sampling_config.temperature == 0.7
    assert cfg.rl_config.rollout_is == "token"
    assert cfg.actor_update_config().temperature == 0.7


def test_the_lr_schedule_is_in_iterations():
    """lr_decay_iters (default train_iters) counts iterations; the worker learns how many optimizer steps make
    one: epochs × the batch's mini-batches, DAPO's filtered batch where it trains."""
    cfg = load_trainer_config("grpo_tiny_cpu", ["rl_config.mini_batch_size=1", "rl_config.epochs=3",
                                                "actor_config.micro_batch_size=1"])
    update = cfg.actor_update_config()
    assert (update.lr_decay_iters, update.steps_per_iteration) == (cfg.actor_config.train_iters, 3 * 4)
    dapo = load_trainer_config("grpo_tiny_cpu", [
        "rl_config.mini_batch_size=1", "actor_config.micro_batch_size=1", "+actor_config.lr_decay_iters=7",
        "+rl_config.filter_groups_enable=true", "+rl_config.filter_groups_metric=acc",
        "+rl_config.filter_groups_train_batch_size=2"])
    assert (dapo.actor_update_config().lr_decay_iters, dapo.actor_update_config().steps_per_iteration) == (7, 2)


def test_model_comes_from_the_defaults_list():
    cfg = load_trainer_config("grpo_tiny_cpu", ["model=[small_qwen]", "megatron_training.model=small_qwen",
                                                "actor_config.model=small_qwen"])
    assert cfg.actor_config.arch.num_layers == 8


def test_a_role_section_overrides_architecture_keys():
    cfg = load_trainer_config("grpo_tiny_cpu", ["+actor_config.num_layers=2"])
    assert cfg.actor_config.arch.num_layers == 2 and cfg.megatron_training.arch.num_layers == 4


def test_noop_layers_are_read_as_a_layer_list_of_the_real_layers():
    """MindSpeed-LLM pads num_layers with identity layers to fill the stages; mindrl runs the real ones."""
    cfg = load_trainer_config("grpo_tiny_cpu", ["+actor_config.num_layers=6", "+actor_config.noop_layers='2,5'",
                                                "actor_config.pipeline_model_parallel_size=2"])
    assert cfg.actor_config.arch.num_layers == 4 and cfg.actor_config.parallel.layers_per_stage(
        cfg.actor_config.arch) == [2, 2]
    # in megatron_training, which has no stages, with the roles' stages: each section runs the real layers
    cfg = load_trainer_config("grpo_tiny_cpu", ["+megatron_training.num_layers=6",
                                                "+megatron_training.noop_layers='2,5'",
                                                "actor_config.pipeline_model_parallel_size=2"])
    assert (cfg.megatron_training.arch.num_layers, cfg.ref_config.arch.num_layers) == (4, 4)
    assert cfg.actor_config.parallel.layers_per_stage(cfg.actor_config.arch) == [2, 2]
    with pytest.raises(ConfigError, match="sets both noop_layers and num_layer_list"):
        load_trainer_config("grpo_tiny_cpu", ["+actor_config.num_layers=6", "+actor_config.noop_layers='2,5'",
                                              "actor_config.pipeline_model_parallel_size=2",
                                              "+actor_config.num_layer_list='2,2'"])


@pytest.mark.parametrize("heads, groups, tp, allowed", [(4, 2, 4, True), (8, 2, 4, True), (6, 2, 3, False),
                                                      (12, 4, 6, False), (8, 8, 4, True), (32, 4, 8, True)])
def test_an_engine_cuts_key_value_heads_or_copies_them_as_vllm_does(heads, groups, tp, allowed):
    """vLLM gives each of TP > groups ranks a copy of one key-value head, so TP need only divide or be a multiple of
    the groups (Qwen3-30B-A3B's 4 at MindSpeed-RL's expert split of 8)."""
    arch = dataclasses.replace(load_model_arch("tiny_qwen"), num_attention_heads=heads, num_query_groups=groups,
                               ffn_hidden_size=96, hidden_size=96)
    gen = GenerateConfig(infer_tensor_parallel_size=tp)
    if allowed:
        gen.check_engine_layout(arch, 2 * tp)
        return
    with pytest.raises(ConfigError, match=rf"infer_tensor_parallel_size={tp} neither divides "
                                          rf"num_query_groups={groups} .* nor is a multiple of it"):
        gen.check_engine_layout(arch, 2 * tp)


def test_an_expert_split_wider_than_the_engine_widens_it_with_a_notice():
    """MindSpeed-RL's infer_expert_parallel_size = k × infer_tensor_parallel_size (vLLM's data-parallel attention)
    becomes engines of that many ranks holding the same expert share; the key-value heads are then copied."""
    cfg = load_trainer_config("grpo_tiny_cpu", [*MOE, "+generate_config.enable_expert_parallel=true",
                                                "+generate_config.infer_expert_parallel_size=4",
                                                "generate_config.infer_tensor_parallel_size=2",
                                                "~rl_config.actor_resource", "+rl_config.actor_resource={num_gpus: 4}"])
    gen = cfg.generate_config
    assert (gen.infer_tensor_parallel_size, gen.infer_expert_parallel_size, gen.widened_from) == (4, 4, 2)
    assert cfg.actor_config.arch.query_groups < 4
    [notice] = [n for n in cfg.notices if "infer_expert_parallel_size" in n]
    assert "over infer_tensor_parallel_size=2" in notice and "each engine spans 4 ranks" in notice
    assert not [n for n in load_trainer_config("grpo_tiny_cpu", MOE).notices if "infer_expert" in n]


# (overrides, words the one-sentence message must contain)
#: grpo_tiny_cpu turned into PPO with a critic in the actor's processes
PPO = ["megatron_training.stage=ray_ppo", "rl_config.adv_estimator=gae"]
#: grpo_tiny_cpu on the tiny mixture of experts
MOE = ["model=tiny_qwen3_moe", "megatron_training.model=tiny_qwen3_moe", "actor_config.model=tiny_qwen3_moe"]
#: padding-free micro-batches cut by a token budget
PACKING = ["+rl_config.use_remove_padding=true", "+rl_config.use_dynamic_bsz=true"]
MISTAKES = {
    "unknown key": (["+rl_config.n_sample_per_prompt=4"], ["rl_config", "n_sample_per_prompt", "n_samples_per_prompt"]),
    "unknown megatron key": (["+actor_config.lr_decay_stile=cosine"], ["actor_config", "lr_decay_style"]),
    "unknown sampling key": (["+generate_config.sampling_config.temprature=1.0"], ["temperature"]),
    "unknown generate key": (["+generate_config.max_modle_len=1024"], ["generate_config", "max_model_len"]),
    "refused generate key": (["+generate_config.num_scheduler_steps=4"], ["generate_config.num_scheduler_steps",
                                                                           "multi-step scheduling"]),
    "kernel generate key": (["+generate_config.torchair_graph=true"], ["generate_config.torchair_graph",
                                                                        "fused kernel"]),
    "sampling not a mapping": (["generate_config.sampling_config=7"], ["generate_config.sampling_config", "mapping"]),
    "unknown section": (["+critic_conf.lr=1e-6"], ["critic_conf"]),
    "critic without gae": (["+critic_config.lr=1e-6"], ["critic_config", "adv_estimator: gae"]),
    "critic resource without gae": (["+rl_config.critic_resource={num_cpus: 1}"], ["critic_resource", "gae"]),
    "gae on the grpo stage": (["rl_config.adv_estimator=gae"], ["stage", "ray_ppo"]),
    "colocated critic layout": ([*PPO, "+critic_config.tensor_model_parallel_size=2"],
                                ["critic_resource", "TP=1 PP=1", "TP=2 PP=1"]),
    "critic micro batch": ([*PPO, "+critic_config.micro_batch_size=3"], ["critic mini-batch", "micro_batch_size=3"]),
    "critic mini batch": ([*PPO, "+rl_config.critic_mini_batch_size=3"], ["critic's mini-batch of 3"]),
    "adaptive kl without the reward penalty": (["+rl_config.kl_ctrl_type=adaptive"], ["adaptive", "use_kl_in_reward"]),
    "adaptive kl target out of reach": (
        [*PPO, "+rl_config.use_kl_in_reward=true", "+rl_config.kl_ctrl_type=adaptive", "+rl_config.kl_target=100"],
        ["kl_target=100", "never reached", "at most 10"]),
    "kl in the reward without gae": (["+rl_config.use_kl_in_reward=true"], ["use_kl_in_reward", "gae"]),
    "gamma range": (["+rl_config.gamma=1.5"], ["gamma", "[0, 1]"]),
    "negative non-finite steps": (["+rl_config.max_nonfinite_steps=-1"], ["rl_config.max_nonfinite_steps", ">= 0"]),
    "value clip": ([*PPO, "+rl_config.cliprange_value=0"], ["cliprange_value", "positive"]),
    "refused MindSpeed key": (["+megatron_training.use_flash_attn=true"], ["use_flash_attn", "kernel"]),
    "tp vs heads": (["actor_config.tensor_model_parallel_size=8"],
                    ["tensor_model_parallel_size", "num_attention_heads"]),
    "pp vs layers": (["actor_config.pipeline_model_parallel_size=3", "rl_config.actor_resource.num_cpus=3"],
                     ["num_layers", "pipeline_model_parallel_size"]),
    "tp vs world": (["actor_config.tensor_model_parallel_size=2", "rl_config.actor_resource.num_cpus=3"],
                    ["world size 3"]),
    "infer tp": (["generate_config.infer_tensor_parallel_size=3"], ["generate_config", "num_attention_heads"]),
    "gbs vs mini": (["rl_config.mini_batch_size=3"], ["global_batch_size=4", "mini_batch_size=3"]),
    "micro batch": (["actor_config.micro_batch_size=3"], ["micro_batch_size=3"]),
    "reference dp split": (["rl_config.use_integrated_worker=false", "+rl_config.reference_resource={num_cpus: 3}"],
                           ["16 samples", "ref_config's 3 data-parallel ranks"]),
    "filtered batch dp split": (["rl_config.use_integrated_worker=false", "+rl_config.reference_resource={num_cpus: 4}",
                                 "rl_config.n_samples_per_prompt=2", "rl_config.mini_batch_size=1",
                                 "actor_config.micro_batch_size=1", "+rl_config.filter_groups_enable=true",
                                 "+rl_config.filter_groups_metric=acc", "+rl_config.filter_groups_train_batch_size=1"],
                                ["filter_groups_train_batch_size × n_samples_per_prompt = 2 samples",
                                 "ref_config's 4 data-parallel ranks"]),
    "rollout split": (["megatron_training.global_batch_size=3", "rl_config.mini_batch_size=1",
                       "rl_config.n_samples_per_prompt=2", "actor_config.micro_batch_size=1"], ["2 rollout engines"]),
    "group of one": (["rl_config.n_samples_per_prompt=1"], ["n_samples_per_prompt=1"]),
    "group of one, baseline": (["rl_config.n_samples_per_prompt=1",
                                "rl_config.adv_estimator=reinforce_plus_plus_baseline"],
                               ["reinforce_plus_plus_baseline", "n_samples_per_prompt=1"]),
    "colocation": (["+rl_config.colocate_actor_ref=false"], ["colocate_actor_ref", "use_integrated_worker"]),
    "colocation all": (["rl_config.use_integrated_worker=false", "+rl_config.colocate_all_models=true",
                        "+rl_config.colocate_actor_ref=false"], ["colocate_all_models", "colocate_actor_ref"]),
    "integrated ref resource": (["+rl_config.reference_resource={num_cpus: 2}"], ["reference_resource"]),
    "missing ref devices": (["rl_config.use_integrated_worker=false"], ["reference_resource"]),
    "max_model_len": (["generate_config.max_model_len=600"], ["max_model_len=600", "768"]),
    "beyond positions": (["generate_config.max_model_len=2048", "megatron_training.seq_length=2048"],
                         ["max_position_embeddings"]),
    "resource key": (["~rl_config.actor_resource", "+rl_config.actor_resource={num_tpus: 2}"],
                     ["num_npus", "num_gpus", "num_cpus"]),
    "verifier": (["rl_config.verifier_function=[acc, nope]"], ["nope"]),
    "weights": (["rl_config.verifier_weight=[1.0]"], ["verifier_weight"]),
    "kl estimator": (["rl_config.kl_penalty=k9"], ["k9", "kl_penalty"]),
    "adv estimator": (["rl_config.adv_estimator=gea"], ["gea", "adv_estimator", "gae"]),
    "rollout_is": (["+rl_config.rollout_is=batch"], ["rollout_is"]),
    "policy loss": (["+rl_config.policy_loss=gpg"], ["gpg", "policy_loss", "gspo"]),
    "sequence parallelism off for an MoE under TP": (
        [*MOE, "actor_config.tensor_model_parallel_size=2", "+actor_config.sequence_parallel=false"],
        ["actor_config", "sequence_parallel is false", "mixture of experts", "leave it unset",
         "tensor_model_parallel_size 1"]),
    "prompt packing under sequence parallelism": (
        ["actor_config.tensor_model_parallel_size=2", "+actor_config.sequence_parallel=true",
         "+rl_config.prompt_packing=true"], ["prompt_packing: true", "actor_config runs sequence-parallel", "auto"]),
    "sequence parallel type": (["+actor_config.sequence_parallel=3"],
                               ["actor_config.sequence_parallel", "true or false"]),
    "EP on a dense model": (["+actor_config.expert_model_parallel_size=2"], ["expert_model_parallel_size=2",
                                                                           "mixture-of-experts"]),
    "LoRA on multi-latent attention": (["model=tiny_deepseek_v3", "megatron_training.model=tiny_deepseek_v3",
                                        "actor_config.model=tiny_deepseek_v3",
                                        "+actor_config.lora_target_modules=[linear_proj]"],
                                       ["actor_config.lora_target_modules", "multi-latent attention",
                                        "tiny_deepseek_v3", "without LoRA"]),
    "vLLM's multi-latent attention on CPU": (["model=tiny_deepseek_v3", "megatron_training.model=tiny_deepseek_v3",
                                              "actor_config.model=tiny_deepseek_v3", "generate_config.backend=vllm"],
                                             ["multi-latent attention on cpu", "tiny_deepseek_v3",
                                              "generate_config.backend: megatron"]),
    "routing replay with vLLM": ([*MOE, "+generate_config.rollout_routing_replay=true",
                                  "generate_config.backend=vllm"], ["rollout_routing_replay", "backend megatron"]),
    "routing replay on a dense model": (["+generate_config.rollout_routing_replay=true",
                                         "generate_config.backend=megatron"], ["rollout_routing_replay", "has none"]),
    "vLLM EP without the switch": (["+generate_config.infer_expert_parallel_size=2"],
                                   ["infer_expert_parallel_size=2", "enable_expert_parallel: true"]),
    "vLLM EP not a multiple of the engine": (["+generate_config.enable_expert_parallel=true",
                                              "generate_config.infer_tensor_parallel_size=2",
                                              "+generate_config.infer_expert_parallel_size=3"],
                                             ["must equal infer_tensor_parallel_size=2 or a multiple of it", "got 3"]),
    "noop layers inside a stage": (["+actor_config.num_layers=6", "+actor_config.noop_layers=1",
                                    "actor_config.pipeline_model_parallel_size=2"],
                                   ["noop_layers puts layer 1 inside pipeline stage 0", "end of its stage"]),
    "vLLM EP on a dense model": (["+generate_config.enable_expert_parallel=true", "generate_config.backend=vllm"],
                                 ["enable_expert_parallel", "tiny_qwen has none"]),
    "vLLM EP on CPU": ([*MOE, "+generate_config.enable_expert_parallel=true",
                        "generate_config.backend=vllm"], ["MoE kernel on cpu", "enable_expert_parallel must be false"]),
    "vLLM EP in the Megatron engine": ([*MOE, "+generate_config.enable_expert_parallel=true",
                                        "generate_config.backend=megatron"], ["enable_expert_parallel", "turn it off"]),
    "gspo dual clip": (["+rl_config.policy_loss=gspo", "+rl_config.clip_ratio_c=3.0"], ["clip_ratio_c", "gspo"]),
    "type": (["rl_config.epochs=two"], ["rl_config.epochs", "integer"]),
    "lr schedule": (["actor_config.lr_decay_style=exp"], ["actor_config.lr_decay_style", "cosine"]),
    "both scheduler switches": (["+megatron_training.override_opt_param_scheduler=true",
                                 "+megatron_training.use_checkpoint_opt_param_scheduler=true"],
                                ["megatron_training.override_opt_param_scheduler",
                                 "megatron_training.use_checkpoint_opt_param_scheduler", "set one of them to false"]),
    "filter metric": (["+rl_config.filter_groups_enable=true", "+rl_config.filter_groups_metric=strict_format"],
                      ["filter_groups_metric"]),
    "engine step below its sequences": (
        ["generate_config.max_num_seqs=64", "generate_config.max_num_batched_tokens=32"],
        ["max_num_batched_tokens=32 is below max_num_seqs=64", "vLLM refuses"]),
    "hydra override": (["rl_config.no_such_key=1"], ["no_such_key"]),
    "group given a number": (["model=5"], ["model=5"]),
    "section not a mapping": (["actor_config=5"], ["actor_config", "mapping"]),
    "sampling type": (["generate_config.sampling_config.temperature=hot"], ["sampling_config.temperature", "number"]),
    "generate type": (["generate_config.enforce_eager=maybe"], ["enforce_eager", "true or false"]),
    "weights not a list": (["rl_config.verifier_weight=1.0"], ["verifier_weight", "list"]),
    "verifiers not a list": (["rl_config.verifier_function=acc"], ["verifier_function", "list"]),
    "reward type": (["rl_config.overlong_buffer=192.5"], ["overlong_buffer", "integer"]),
    "model type": (["+actor_config.norm_epsilon=abc"], ["norm_epsilon", "number"]),
    "model bool": (["+actor_config.untie_embeddings_and_output_weights=yes"], ["untie_embeddings_and_output_weights"]),
    "negative lr": (["actor_config.lr=-1"], ["actor_config.lr", ">= 0"]),
    "min_lr above lr": (["actor_config.min_lr=5.0"], ["actor_config.min_lr=5.0"]),
    "adam beta": (["actor_config.adam_beta1=1.5"], ["actor_config.adam_beta1", "[0, 1)"]),
    "vLLM-CPU prefill": (["generate_config.max_num_batched_tokens=100"], ["max_num_batched_tokens=100", "768"]),
    "no HF family": (["+actor_config.qk_layernorm=true"], ["QK layer norms", "HF family"]),
    "score head on the policy": (["+model.tiny_qwen.num_labels=1"], ["num_labels=1", "LM head"]),
    "token budget without packing": (["+rl_config.use_dynamic_bsz=true"], ["use_dynamic_bsz",
                                                                          "use_remove_padding: true"]),
    "token budget below the longest prompt": (
        [*PACKING, "+rl_config.update_max_packing_token_size=500"],
        ["rl_config.update_max_packing_token_size=500", "max_prompt_length=512", "never cut"]),
    "balance without packing": (["+rl_config.use_dp_batch_balance=true"], ["use_dp_batch_balance",
                                                                           "use_remove_padding: true"]),
    "packed samples that see each other": (["+rl_config.use_remove_padding=true",
                                            "+megatron_training.reset_attention_mask=false"],
                                           ["actor_config.reset_attention_mask: false", "use_remove_padding"]),
    "recompute keys that conflict": (["+actor_config.recompute_granularity=selective",
                                      "+actor_config.recompute_num_layers=2"],
                                     ["actor_config.recompute_granularity: selective", "conflict"]),
    "recompute of more layers than a stage holds": (
        ["+actor_config.recompute_granularity=full", "+actor_config.recompute_method=block",
         "+actor_config.recompute_num_layers=8"], ["actor_config.recompute_num_layers=8", "4 layers"]),
    "recompute of the activation alone": (["+megatron_training.recompute_activation_function=true"],
                                          ["recompute_activation_function", "selective"]),
    "context parallelism without packing": (["+actor_config.context_parallel_size=2"],
                                            ["actor_config.context_parallel_size=2", "use_remove_padding: true"]),
    "ulysses with key-value groups that do not divide": (
        [*PACKING, "+actor_config.context_parallel_size=4"],
        ["actor_config", "num_query_groups=2", "megatron_cp_algo"]),
    "a budget below two chunks per context-parallel rank": (
        [*PACKING, "+actor_config.context_parallel_size=2", "+rl_config.max_packing_token_size=3"],
        ["max_packing_token_size=3", "2 × context_parallel_size = 4"]),
    "an unknown context-parallel algorithm": (["+actor_config.context_parallel_algo=ring"],
                                              ["context_parallel_algo", "megatron_cp_algo"]),
    "an attention mask mindrl does not compute": (["+megatron_training.attention_mask_type=sliding"],
                                                  ["attention_mask_type", "causal or general"]),
    "missing config": None,
}


@pytest.mark.parametrize("source, words", [
    ("this is not python(", ["fails to load", "SyntaxError"]),
    ("def f(response, label):\n    return 1.0\n", ["declares no worst score", "verifier_fail_score"]),
])
def test_a_custom_verifier_is_checked_before_ray(tmp_path, source, words):
    """Its module loads and its fail score is known at config time, not in a scorer on the cluster."""
    (tmp_path / "mine.py").write_text(source)
    with pytest.raises(ConfigError) as err:
        load_trainer_config("grpo_tiny_cpu", [f"rl_config.verifier_function=[acc,{tmp_path / 'mine.py'}:f]",
                                              "rl_config.verifier_weight=[1.0,1.0]"])
    _one_sentence(str(err.value))
    assert all(word in str(err.value) for word in words), err.value


def _one_sentence(message: str) -> None:
    assert "\n" not in message and message.endswith((".", "?")), message
    assert message.count(". ") == 0 or "e.g." in message or "etc." in message, message


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_each_mistake_is_one_quick_sentence(case):
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        if MISTAKES[case] is None:
            load_trainer_config("grpo_tiny_gpu")
        else:
            load_trainer_config("grpo_tiny_cpu", MISTAKES[case][0])
    elapsed = time.perf_counter() - start
    message = str(err.value)
    _one_sentence(message)
    for word in (MISTAKES[case] or ([], ["grpo_tiny_gpu", "grpo_tiny_cpu"]))[1]:
        assert word in message, (word, message)
    assert elapsed < 5.0, elapsed


@pytest.mark.parametrize("cluster, words", [
    (Cluster({"CPU": 1}), ["2 CPU", "offers 1 CPU"]),
    (Cluster({"GPU": 8}), ["offers 8 GPU", "num_cpus"]),
])
def test_resources_the_cluster_cannot_give(cluster, words):
    cfg = load_trainer_config("grpo_tiny_cpu")
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        check_resources(cfg, cluster)
    _one_sentence(str(err.value))
    assert all(w in str(err.value) for w in words), str(err.value)
    assert time.perf_counter() - start < 5.0


def test_integrated_reference_shares_the_actor_layout():
    cfg = load_trainer_config("grpo_qwen25_7b")
    assert cfg.ref_config is cfg.actor_config and cfg.ref_config.parallel.tp == 2
    assert cfg.megatron_training.parallel.tp == 1


def test_separate_reference_counts_its_own_devices():
    cfg = load_trainer_config("grpo_tiny_cpu", ["rl_config.use_integrated_worker=false",
                                                "+rl_config.reference_resource={num_cpus: 2}"])
    assert [g for g, _ in cfg.device_groups()] == ["actor", "reference"] and cfg.devices_held() == 4
    with pytest.raises(ConfigError, match="2 \\(actor\\) \\+ 2 \\(reference\\) = 4 CPU"):
        check_resources(cfg, Cluster({"CPU": 2}))
    colocated = load_trainer_config("grpo_tiny_cpu", ["rl_config.use_integrated_worker=false",
                                                      "+rl_config.colocate_actor_ref=true"])
    assert [g for g, _ in colocated.device_groups()] == ["actor+reference"] and colocated.devices_held() == 2
    check_resources(colocated, Cluster({"CPU": 2}))


def test_rule_reward_batch_must_split_over_nodes():
    cfg = load_trainer_config("grpo_qwen25_7b")
    with pytest.raises(ConfigError, match="3 nodes"):
        check_resources(cfg, Cluster({"NPU": 48, "CPU": 600}, nodes=3))


def test_ray_cluster_description():
    cluster = Cluster.from_ray({"CPU": 384.0, "NPU": 32.0, "memory": 1e12, "node:10.0.0.1": 1.0,
                                "node:10.0.0.2": 1.0, "node:__internal_head__": 1.0})
    assert cluster.nodes == 2 and cluster.offers("NPU") == 32
    check_resources(load_trainer_config("grpo_qwen25_32b"), cluster)


def _reference(name: str) -> Path:
    path = REFERENCE / f"{name}.yaml"
    if not path.is_file():
        pytest.skip(f"MindSpeed-RL reference configs not found at {REFERENCE}")
    return path


PATHS = ["megatron_training.tokenizer_name_or_path=data/tok", "megatron_training.data_path=data/prompts"]
#: MindSpeed-RL's recipes that do not load, with what stops them: the A2 DeepSeek recipe's prompts (8196 tokens) and
#: responses (2048) do not fit its vLLM context (10240)
NOT_LOADING = {"grpo_deepseek_r1_671b_A2": r"generate_config\.max_model_len=10240 is shorter than max_prompt_length "
                                           r"\+ max_tokens = 8196 \+ 2048; raise it to at least 10244"}
#: the reasons a MindSpeed-RL key may be dropped for: a kernel choice or behaviour mindrl fixes, never a feature
DROPPABLE = ("picks a fused kernel or memory layout", "is fixed in mindrl", "is never read by MindSpeed-RL",
             "asks for vLLM's asynchronous engine")


def _reference_names() -> list[str]:
    return sorted(p.stem for p in REFERENCE.glob("*.yaml")) or ["grpo_qwen25_7b_A3"]


def test_every_mindspeed_recipe_is_tested():
    """Its 16 GRPO, DAPO and PPO recipes and its DPO recipe."""
    if not REFERENCE.is_dir():
        pytest.skip(f"MindSpeed-RL reference configs not found at {REFERENCE}")
    assert len(_reference_names()) == 17 and set(NOT_LOADING) < set(_reference_names())
    assert "dpo_qwen3_30b_a3b_A3" in _reference_names()


@pytest.mark.parametrize("name", _reference_names())
def test_mindspeed_recipes_load_with_only_paths_changed_dropping_no_feature(name):
    if name in NOT_LOADING:
        with pytest.raises(ConfigError, match=NOT_LOADING[name]) as err:
            load_mindspeed_config(_reference(name), PATHS)
        _one_sentence(str(err.value))
        return
    start = time.perf_counter()
    cfg, notes = load_mindspeed_config(_reference(name), PATHS)
    assert time.perf_counter() - start < 5.0
    for note in notes:
        _one_sentence(note)
        assert any(reason in note for reason in DROPPABLE), note
    named = " ".join(notes)
    if cfg.stage == "dpo":
        _check_the_dpo_recipe(cfg, named)
        return
    assert cfg.megatron_training.tokenizer_name_or_path == "data/tok"
    assert cfg.rl_config.resources["actor_resource"].kind == "NPU"
    for key in ("use_flash_attn", "tokenizer_type", "split", "distributed_backend"):
        assert f".{key} " in named, key
    assert "sequence_parallel" not in named  # a Megatron key with Megatron's meaning (MindSpeed-RL sets it at TP > 1)
    assert sum("megatron_training.use_flash_attn " in n for n in notes) == 1  # once, where it was written
    assert "init_kl_coef" not in named and "n_samples_per_prompt" not in named and "gamma" not in named
    assert cfg.stage == {"dapo": "ray_dapo", "ppo": "ray_ppo"}.get(name.split("_")[0], "ray_grpo")
    if name.endswith("k"):
        assert (cfg.actor_config.parallel.cp, cfg.actor_config.parallel.cp_algo) == (2, "ring")
        assert "context_parallel" not in named and "attention_mask_type" not in named
    if name in ("dapo_qwen3_30b_a3b_A3", "grpo_qwen3_235b_a22b_A2"):  # vLLM's data-parallel attention, widened
        assert cfg.generate_config.infer_tensor_parallel_size == 8
        assert [n for n in cfg.notices if "each engine spans 8 ranks at tensor parallel 8" in n]
    if name == "grpo_qwen3_235b_a22b_A2":  # 94 layers padded to 96 by two no-op layers, an optimizer in host memory
        actor = cfg.actor_config
        assert (actor.arch.num_layers, actor.parallel.layers_per_stage(actor.arch)) == (94, [5, *[6] * 14, 5])
        assert actor.swap_optimizer and [n for n in cfg.notices if n.startswith("moe_tp_extend_ep: true has no")]


def _check_the_dpo_recipe(cfg, named: str) -> None:
    """MindSpeed-RL's DPO file keeps every key in megatron_training (MindSpeed-LLM reads one namespace) and takes its
    devices from torchrun: its DPO keys are dpo_config's, its devices the layout's own, said once."""
    assert (cfg.training.tokenizer_name_or_path, cfg.section.dpo_loss_type, cfg.section.dpo_beta) == (
        "data/tok", "sigmoid", 0.1)
    assert cfg.section.ref_model == "./model_weights/Qwen3-30B-TP2-PP8-EP1/"
    assert (cfg.training.parallel.tp, cfg.training.parallel.pp, cfg.section.resource.kind,
            cfg.section.resource.count) == (2, 8, "NPU", 16)
    assert cfg.notices[0].startswith("dpo_config.resource is not set (a MindSpeed-RL dpo recipe takes its devices")
    assert [n.split(":")[0] for n in cfg.notices[1:]] == ["no_save_optim", "no_save_rng"]
    assert ".is_pairwise_dataset " in named and ".dpo_loss_type" not in named and ".ref_model" not in named


@pytest.mark.parametrize("name", [n for n in _reference_names() if n not in NOT_LOADING])
def test_an_imported_recipe_is_a_mindrl_config_equal_to_the_recipe(name, tmp_path):
    """cli/import_mindspeed.py writes the recipe without its dropped keys; mindrl's own loader, which refuses such
    keys, loads that file for the command the report names, to the configuration the recipe gives."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
    from import_mindspeed import main

    from mindrl.trainer.mindspeed_import import import_recipe

    out = tmp_path / f"{name}.yaml"
    assert main([str(_reference(name)), "--out", str(out), *PATHS]) == 0
    imported = import_recipe(_reference(name), PATHS)
    if imported.cfg.stage == "dpo":
        cfg, fields = load_dpo_config(name, [], tmp_path), ("training", "section", "notices")
    else:
        cfg = trainer_loader(imported.cfg.stage)(name, [], tmp_path)
        fields = ("megatron_training", "actor_config", "ref_config", "reward_config", "critic_config", "rl_config",
                  "generate_config", "loss", "stage", "notices")
    for field in fields:
        assert getattr(cfg, field) == getattr(imported.cfg, field), field
    assert imported.command == {"ray_dapo": "cli/train_dapo.py", "ray_ppo": "cli/train_ppo.py",
                                "dpo": "cli/train_dpo.py"}.get(cfg.stage, "cli/train_grpo.py")
    report = imported.report(out)
    assert all(note.sentence in report for note in imported.dropped) and f"--config-name {name}" in report


@pytest.mark.parametrize("key", ["+rl_config.lora_r=16", "+megatron_training.lerning_rate=1",
                                 "+actor_config.num_layers_per_virtual_pipeline_stage=2",
                                 "+rl_config.swap_optimizer=true"])
def test_an_import_leaves_out_no_feature_key_typo_or_key_in_the_wrong_section(key):
    """Only kernel choices and fixed behaviour may be left out: any other key would train something else."""
    from mindrl.trainer.mindspeed_import import import_recipe

    with pytest.raises(ConfigError, match=re.escape(key.split("=")[0].lstrip("+").split(".")[1])):
        import_recipe(_reference("grpo_qwen25_7b_A3"), [*PATHS, key])


def test_a_recipe_mindrl_cannot_run_is_one_sentence_and_writes_nothing(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
    from import_mindspeed import main

    out = tmp_path / "deepseek.yaml"
    assert main([str(_reference("grpo_deepseek_r1_671b_A2")), "--out", str(out), *PATHS]) == 2
    _one_sentence(capsys.readouterr().err.strip().removeprefix("error: "))
    assert not out.exists() and not list(tmp_path.iterdir())


def test_sequence_parallel_is_a_role_key_with_megatrons_meaning():
    """It reaches the role's TransformerConfig; unset, an MoE under TP is sequence-parallel (megatron-core trains it
    only so) and a dense model is not; at TP=1 it does nothing, as in Megatron, and is said to."""
    from mindrl.models.gpt import transformer_config  # megatron-core: seconds to import

    def sequence_parallel(*overrides: str) -> tuple[bool, list[str]]:
        cfg = load_trainer_config("grpo_tiny_cpu", list(overrides))
        actor = cfg.actor_config
        return (transformer_config(actor.arch, actor.parallel).sequence_parallel,
                [notice for notice in cfg.notices if "sequence_parallel" in notice])

    tp2 = "actor_config.tensor_model_parallel_size=2"
    assert sequence_parallel(tp2) == (False, [])
    assert sequence_parallel(tp2, "+actor_config.sequence_parallel=true") == (True, [])
    assert sequence_parallel(tp2, "+megatron_training.sequence_parallel=true") == (True, [])  # MindSpeed-RL's place
    assert sequence_parallel(*MOE, tp2) == (True, [])
    assert sequence_parallel(*MOE, tp2, "+actor_config.sequence_parallel=true") == (True, [])
    assert sequence_parallel("+megatron_training.sequence_parallel=true") == (False, [
        "sequence_parallel=true has no effect at tensor_model_parallel_size 1 (it cuts activations over the TP ranks; "
        "Megatron turns it off there too)."])
    _, notices = sequence_parallel(*PPO, "+critic_config.sequence_parallel=true",
                                   "+rl_config.critic_resource={num_cpus: 2}")
    assert notices == ["critic_config.sequence_parallel=true has no effect at tensor_model_parallel_size 1 (it cuts "
                       "activations over the TP ranks; Megatron turns it off there too)."]


def test_dapo_reference_keys_map_onto_the_grpo_trainer():
    cfg, _ = load_mindspeed_config(_reference("dapo_qwen3_32b_A3"), PATHS)
    assert (cfg.loss.low, cfg.loss.high) == (0.2, 0.28)
    assert cfg.loss.loss_agg_mode == "token-mean" and not cfg.loss.use_kl_loss
    assert cfg.rl_config.filter_groups_enable and cfg.rl_config.reward.overlong_buffer_enable
    assert cfg.rl_config.reward.verifier_function == ["acc_for_dapo"]


def test_ray_dapo_has_no_kl_loss_and_no_reference_whatever_init_kl_coef_says():
    """MindSpeed-RL's DAPO loss returns a zero KL loss and its DAPO trainer runs no reference: most of its DAPO
    recipes leave init_kl_coef at the 0.01 default, and one given explicitly is said to do nothing."""
    cfg, _ = load_mindspeed_config(_reference("dapo_qwen25_32b_A3"), PATHS)  # no init_kl_coef: the 0.01 default
    assert cfg.stage == "ray_dapo" and not cfg.loss.use_kl_loss and not cfg.rl_config.uses_reference
    assert [group for group, _ in cfg.device_groups()] == ["actor"]
    told = load_trainer_config("dapo_long_tiny_cpu", ["+rl_config.init_kl_coef=0.05"])
    assert not told.loss.use_kl_loss and told.notices[0].startswith(
        "rl_config.init_kl_coef=0.05 has no effect under stage ray_dapo (DAPO's loss has no KL term")
    as_grpo = load_trainer_config("dapo_long_tiny_cpu", ["megatron_training.stage=ray_grpo",
                                                         "+rl_config.init_kl_coef=0.05"])
    assert as_grpo.stage == "ray_grpo" and as_grpo.loss.use_kl_loss and as_grpo.rl_config.uses_reference


def test_gspo_aggregates_per_response_unless_told_otherwise():
    cfg = load_trainer_config("grpo_tiny_cpu", ["+rl_config.policy_loss=gspo", "+rl_config.clip_higher_enable=true",
                                                "+rl_config.clip_ratio_low=3e-4", "+rl_config.clip_ratio_high=4e-4"])
    assert (cfg.loss.policy_loss, cfg.loss.loss_agg_mode, cfg.loss.low, cfg.loss.high) == (
        "gspo", "seq-mean-token-mean", 3e-4, 4e-4)
    told = load_trainer_config("grpo_tiny_cpu", ["+rl_config.policy_loss=gspo", "+rl_config.loss_agg_mode=token-mean"])
    assert told.loss.loss_agg_mode == "token-mean"


def test_a_recipes_tool_file_is_found_beside_it_and_mindspeeds_retool_is_the_python_tool():
    """MindSpeed-RL writes tool_config_path from its repository's root (./configs/tools/… beside the recipes)."""
    cfg, _ = load_mindspeed_config(_reference("dapo_qwen25_7b_A2_multi_turn"), PATHS)
    path = Path(cfg.rl_config.tool_config_path)
    assert path.is_absolute() and path == (REFERENCE / "tools/retool_config.yaml").resolve()
    from mindrl.tools.config import read_tool_config
    from mindrl.tools.sandbox import Limits

    [tool] = read_tool_config(str(path))
    assert tool.schema["function"]["name"] == "code_interpreter"
    assert tool.footprint_bytes == Limits(timeout_s=30, cpu_seconds=30, memory_mb=1024).footprint_bytes


@pytest.mark.parametrize("setting, message", [
    ("default_language: bash", r"ReTool's default_language is 'bash', but mindrl's sandbox runs Python only"),
    ("sandbox_url: x", r"ReTool has no setting 'sandbox_url'; its settings: default_timeout, memory_limit_mb, "
                       r"sandbox_fusion_url"),
])
def test_retool_settings_mindrl_cannot_honour_are_refused(tmp_path, setting, message):
    from mindrl.tools.config import read_tool_config

    file = tmp_path / "tools.yaml"
    file.write_text(f"tools:\n  - class_name: mindspeed_rl.tools.retool.ReTool\n    config:\n      {setting}\n")
    with pytest.raises(ConfigError, match=message):
        read_tool_config(str(file))


def _mindspeed_ppo_file(folder: Path) -> Path:
    """A trainer file in the layout of MindSpeed-RL's PPO example (configs/ppo_qwen25_32b_A3.yaml there): its
    sections and keys, with its values where they matter here."""
    megatron = {"model": "qwen25_32b", "use_fused_rmsnorm": True, "use_mcore_models": True, "sequence_parallel": True,
                "use_flash_attn": True, "no_masked_softmax_fusion": True, "attention_softmax_in_fp32": True,
                "no_gradient_accumulation_fusion": True, "use_fused_swiglu": True, "use_fused_rotary_pos_emb": True,
                "bf16": True, "use_distributed_optimizer": True, "tokenizer_type": "PretrainedFromHF",
                "tokenizer_name_or_path": "./Qwen2.5-32B-Instruct", "global_batch_size": 64, "seq_length": 2048,
                "save_interval": 200, "train_iters": 20000, "stage": "ray_ppo", "attention_dropout": 0.0,
                "init_method_std": 0.01, "hidden_dropout": 0.0, "distributed_backend": "nccl",
                "no_shared_storage": True, "variable_seq_lengths": True, "dataset_additional_keys": ["labels"],
                "data_path": "./data", "split": "100,0,0", "no_shuffle": True,
                "full_shuffle_instruction_dataset": False}
    optimizer = {"model": "qwen25_32b", "micro_batch_size": 1, "tensor_model_parallel_size": 8,
                 "pipeline_model_parallel_size": 1, "lr_decay_style": "constant", "min_lr": 0, "weight_decay": 0.01,
                 "lr_warmup_fraction": 0.0, "clip_grad": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.95,
                 "finetune": True, "load": "./ckpt", "save": "./ckpt", "no_load_optim": True, "no_load_rng": True}
    rl = {"guarantee_order": True, "use_integrated_worker": True, "blocking": True,
          "actor_forward_micro_batch_size": 1, "ref_forward_micro_batch_size": 1, "gamma": 1.0, "lam": 1.0,
          "adv_estimator": "gae", "kl_penalty": "kl", "kl_ctrl_type": "fixed", "init_kl_coef": 0.0,
          "use_kl_in_reward": False, "mini_batch_size": 64, "max_prompt_length": 2048, "epochs": 1,
          "clip_ratio": 0.2, "cliprange_value": 0.5, "entropy_coeff": 0, "shuffle_mini_batch": False,
          "n_samples_per_prompt": 16, "rule_reward": True, "verifier_function": ["math_17k_acc"],
          "verifier_weight": [1.0], "num_cpus_for_local_task": 1.0, "use_tensorboard": False,
          "actor_resource": {"num_npus": 16}, "critic_resource": {"num_npus": 16}}
    generate = {"enforce_eager": True, "trust_remote_code": True, "offload_train_optimizer": True,
                "offload_train_grad": True, "offload_train_param": True, "infer_tensor_parallel_size": 8,
                "infer_pipeline_parallel_size": 1, "infer_expert_parallel_size": 1, "max_num_seqs": 1024,
                "max_model_len": 4096, "max_num_batched_tokens": 8192, "dtype": "bfloat16",
                "gpu_memory_utilization": 0.4,
                "sampling_config": {"logprobs": 1, "max_tokens": 2048, "top_p": 1, "top_k": -1, "min_p": 0.0,
                                    "temperature": 1.0, "detokenize": False}}
    data = {"defaults": [{"model": ["qwen25_32b"]}], "megatron_training": megatron,
            "actor_config": {**optimizer, "lr": 1e-6}, "critic_config": {**optimizer, "lr": 5e-6},
            "rl_config": rl, "generate_config": generate}
    path = folder / "ppo_qwen25_32b_A3.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_each_trainer_refuses_the_others_config():
    with pytest.raises(ConfigError, match=r"^adv_estimator gae trains a critic; run ppo_tiny_cpu with "
                                          r"cli/train_ppo\.py"):
        trainer_loader("ray_grpo")("ppo_tiny_cpu")
    with pytest.raises(ConfigError, match=r"^cli/train_ppo\.py trains a critic for adv_estimator: gae, but "
                                          r"grpo_tiny_cpu's is group_norm"):
        trainer_loader("ray_ppo")("grpo_tiny_cpu")
    with pytest.raises(ConfigError, match=r"^dapo_long_tiny_cpu is stage ray_dapo; run it with cli/train_dapo\.py\.$"):
        trainer_loader("ray_grpo")("dapo_long_tiny_cpu")
    with pytest.raises(ConfigError, match=r"\.stage='ray_grpo' is not what cli/train_dapo\.py trains; use ray_dapo; "
                                          r"ray_grpo runs with cli/train_grpo\.py\.$"):
        trainer_loader("ray_dapo")("grpo_tiny_cpu")


def test_mindspeed_rls_ppo_file_loads_as_ppo_and_names_its_unsupported_keys(tmp_path):
    cfg, notes = load_mindspeed_config(_mindspeed_ppo_file(tmp_path))
    for note in notes:
        _one_sentence(note)
    named = " ".join(notes)
    for key in ("use_flash_attn", "guarantee_order", "blocking", "split", "tokenizer_type"):
        assert f".{key} " in named, key
    assert not any(word in named for word in ("gamma", "lam ", "cliprange_value", "critic_resource", "adv_estimator",
                                              "sequence_parallel"))
    rl, critic = cfg.rl_config, cfg.critic_config
    for role in (cfg.actor_config, critic):  # megatron_training's sequence_parallel: true, at TP=8
        assert role.parallel.sequence_parallel_for(role.arch)
    assert rl.trains_critic and (rl.gamma, rl.lam, rl.cliprange_value) == (1.0, 1.0, 0.5)
    assert cfg.critic_on_own_devices and critic.lr == 5e-6 and critic.arch.num_labels == 1
    assert (critic.parallel.tp, cfg.critic_update_config().mini_batch_size) == (8, 64 * 16)
    assert [group for group, _ in cfg.device_groups()] == ["actor", "critic"]  # init_kl_coef 0: no reference
    assert cfg.devices_held() == sum(resource.count for _, resource in cfg.device_groups()) > \
        cfg.rl_config.resources["actor_resource"].count
    check_resources(cfg, Cluster({"NPU": 32, "CPU": 64}, nodes=2))


@pytest.mark.parametrize("interval, save, steps", [(2, "run", [2, 4, 5]), (5, "run", [5]), (0, "run", [5]),
                                                   (2, None, [])])
def test_checkpoints_are_written_every_save_interval_steps_and_after_the_last_step(interval, save, steps):
    """The trainers ask saves_at after each step; the last step is saved though the interval does not divide it."""
    cfg = MegatronConfig(train_iters=5, save_interval=interval, save=save)
    assert [step for step in range(1, 6) if cfg.saves_at(step)] == steps


def test_packing_keys_reach_each_pass_and_a_budget_below_the_longest_sample_is_said():
    """MindSpeed-RL's keys: each pass its own budget, else max_packing_token_size (not MindSpeed-RL's frozen 4096);
    a budget the longest sample (512 + 256 tokens) exceeds leaves that sample alone in its micro-batch, said once."""
    cfg = load_trainer_config("grpo_tiny_cpu", [*PACKING, "+rl_config.max_packing_token_size=1024",
                                                "+rl_config.update_max_packing_token_size=600",
                                                "+rl_config.ref_dynamic_max_batch_size=4",
                                                "+rl_config.use_dp_batch_balance=true"])
    rl = cfg.rl_config
    assert rl.batching("ref") == Batching(True, 1024, 4, balance=True)
    assert rl.batching("actor") == Batching(True, 1024, None, balance=True)
    assert cfg.actor_update_config().batching == rl.batching("update") == Batching(True, 600, None, balance=True)
    assert rl.batching("reward") == rl.batching("critic") == Batching(True, 1024, None, balance=True)
    said = [notice for notice in cfg.notices if "max_packing_token_size" in notice]
    assert said == ["rl_config.update_max_packing_token_size=600 is below the longest sample this run can make (768 "
                    "tokens: max_prompt_length + the response's limit); such a sample is alone in its micro-batch, "
                    "whose activations then follow the sample, not the budget; raise it to 768 to bound every "
                    "micro-batch."]
    plain = load_trainer_config("grpo_tiny_cpu", ["+rl_config.use_remove_padding=true"]).rl_config
    assert plain.batching("update") == Batching(remove_padding=True)
    assert load_trainer_config("grpo_tiny_cpu").actor_update_config().batching == Batching()


def test_a_vision_language_model_is_not_packed():
    with pytest.raises(ConfigError) as err:
        load_trainer_config("grpo_tiny_vl_cpu", ["+rl_config.use_remove_padding=true"])
    _one_sentence(str(err.value))
    assert "vision-language" in str(err.value) and "use_remove_padding: false" in str(err.value)
