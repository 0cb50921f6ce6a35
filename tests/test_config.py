"""Architecture files and parallel-layout validation."""

import dataclasses
from pathlib import Path

import pytest
import torch.distributed as dist

from mindrl.config import ConfigError, ModelArch, ParallelConfig, load_model_arch, validate_parallel
from mindrl.config.parallel import validate_sequence_parallel, without_noop_layers
from mindrl.config.paths import MODEL_CONFIGS_DIR

REFERENCE_MODELS = Path(__file__).resolve().parents[2] / "shared/reference/mindspeed_rl/configs/model"

# Numbers from the published HF config.json of each model.
PUBLISHED = {
    "qwen25_0p5b": dict(num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14,
                        query_groups=2, padded_vocab_size=151936, tied_embeddings=True),
    "qwen25_1p5b": dict(num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
                        query_groups=2, padded_vocab_size=151936, tied_embeddings=True),
    "qwen25_7b": dict(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                      query_groups=4, padded_vocab_size=152064, tied_embeddings=False),
    "qwen25_32b": dict(num_layers=64, hidden_size=5120, ffn_hidden_size=27648, num_attention_heads=40,
                       query_groups=8, padded_vocab_size=152064, tied_embeddings=False),
    "llama3_8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                      query_groups=8, padded_vocab_size=128256, tied_embeddings=False, rotary_base=500000),
    "llama31_8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                       query_groups=8, padded_vocab_size=128256, tied_embeddings=False, rotary_base=500000,
                       max_position_embeddings=131072, rope_scaling_type="llama3", rope_scaling_factor=8.0,
                       rope_scaling_original_max_position_embeddings=8192),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_architectures_match_published_configs(name):
    arch = load_model_arch(name)
    for key, value in PUBLISHED[name].items():
        assert getattr(arch, key) == value, key
    assert arch.swiglu and arch.normalization == "RMSNorm"
    assert arch.add_qkv_bias == name.startswith("qwen")
    assert isinstance(arch.norm_epsilon, float)


def test_tiny_model_fits_vllm_cpu_and_parallel_tests():
    arch = load_model_arch("tiny_qwen")
    assert arch.head_dim in (32, 64)
    validate_parallel(arch, ParallelConfig(2, 2), world_size=4)
    validate_parallel(arch, ParallelConfig(1, 2, num_layer_list="1,3"))


def test_every_shipped_model_file_loads():
    names = sorted(p.stem for p in MODEL_CONFIGS_DIR.glob("*.yaml"))
    assert {"tiny_qwen", *PUBLISHED} <= set(names)
    for name in names:
        assert load_model_arch(name).name == name


@pytest.mark.skipif(not REFERENCE_MODELS.is_dir(), reason="MindSpeed-RL reference configs not present")
@pytest.mark.parametrize("name", ["qwen25_7b", "qwen25_32b", "qwen3_32b"])
def test_mindspeed_rl_model_yamls_load_unchanged(name):
    arch = load_model_arch(name, REFERENCE_MODELS)
    assert arch.num_layers == 64 if name != "qwen25_7b" else arch.num_layers == 28
    if name == "qwen3_32b":
        assert arch.qk_layernorm and arch.head_dim == 128 and not arch.add_qkv_bias


def test_vocab_padding_is_a_multiple_of_tp():
    arch = ModelArch.from_dict("m", dict(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                                         num_attention_heads=2, padded_vocab_size=1001,
                                         max_position_embeddings=64, make_vocab_size_divisible_by=8))
    assert arch.vocab_size_for(1) == 1008
    assert arch.vocab_size_for(2) == 1008
    assert arch.vocab_size_for(4) == 1024


def test_unknown_key_is_an_error_that_lists_known_keys():
    with pytest.raises(ConfigError, match=r"unknown key 'hiden_size'.*hidden_size"):
        ModelArch.from_dict("m", {"hiden_size": 3})


def test_moe_keys_mindrl_does_not_build_are_rejected_not_ignored():
    dense = dict(load_model_arch("tiny_qwen").__dict__)
    dense.pop("name")
    for key, value in (("moe_expert_capacity_factor", 1.5), ("moe_router_bias_update_rate", 1e-3)):
        with pytest.raises(ConfigError, match=f"key '{key}' asks for .*which mindrl does not build"):
            ModelArch.from_dict("m", {**dense, "num_experts": 8, key: value})


DEEPSEEK_STYLE = dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, first_k_dense_replace=2,
                      moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, norm_topk_prob=True,
                      moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5)


def test_deepseek_style_keys_read_as_mindspeed_llm_writes_them():
    dense = dict(load_model_arch("tiny_qwen").__dict__)
    dense.pop("name")
    arch = ModelArch.from_dict("m", {**dense, **DEEPSEEK_STYLE, "n_shared_experts": 2, "moe_layer_freq": 1,
                                     "seq_aux": False})
    assert arch.moe_shared_expert_intermediate_size == 64 and not arch.moe_shared_expert_gate
    assert list(arch.moe_layers) == [2, 3] and arch.layer_arch(1).num_experts is None and arch.layer_arch(2) is arch
    assert arch.layer_arch(0).first_k_dense_replace == 0 and arch.layer_arch(0).ffn_hidden_size == arch.ffn_hidden_size


@pytest.mark.parametrize("bad, message", [
    (dict(moe_layer_freq=2), r"moe_layer_freq=2 places experts every few layers"),
    (dict(seq_aux=True), r"seq_aux: true asks for the sequence-level balancing loss; set moe_router_load_balancing"),
    (dict(n_shared_experts=1, moe_shared_expert_intermediate_size=48), r"makes a shared expert 32 wide, but"),
    (dict(moe_router_num_groups=3), r"moe_router_num_groups=3 does not divide num_experts=8"),
    (dict(moe_router_group_topk=3), r"moe_router_group_topk=3 must be a count of groups from 1 to"),
    (dict(moe_router_topk=4), r"with moe_router_group_topk=1 set moe_router_topk to 2 or 3"),
    (dict(moe_router_group_topk=None), r"set both or neither"),
    (dict(norm_topk_prob=False), r"sigmoid routing renormalises its top-k weights .* norm_topk_prob must be true"),
    (dict(moe_router_score_function="softmax"), r"moe_router_enable_expert_bias biases sigmoid scores"),
    (dict(moe_router_score_function="tanh", moe_router_enable_expert_bias=False), r"'tanh' is not one mindrl builds"),
    (dict(first_k_dense_replace=4), r"first_k_dense_replace=4 must be a count of dense layers from 0 to"),
    (dict(moe_router_topk_scaling_factor=0), r"moe_router_topk_scaling_factor must be a positive number"),
    (dict(rotary_percent=0.3), r"rotary_percent=0.3 must be in \(0, 1\] and rotate an even number"),
    (dict(rotary_percent=0.5, rope_scaling_type="yarn", rope_scaling_factor=4.0),
     r"YaRN's attention factor scales the rotated dimensions alone"),
])
def test_deepseek_style_mistakes_are_one_sentence(bad, message):
    dense = dict(load_model_arch("tiny_qwen").__dict__)
    dense.pop("name")
    with pytest.raises(ConfigError, match=message):
        ModelArch.from_dict("m", {**dense, **DEEPSEEK_STYLE, **bad})


@pytest.mark.parametrize("bad, message", [
    (dict(kv_lora_rank=None), r"multi-latent attention needs kv_lora_rank as a positive integer, got None"),
    (dict(qk_pos_emb_head_dim=15), r"qk_pos_emb_head_dim=15 must be even"),
    (dict(kv_channels=96), r"multi-latent attention does not take kv_channels"),
    (dict(num_query_groups=2), r"multi-latent attention does not take num_query_groups"),
    (dict(qk_layernorm=False), r"does not take qk_layernorm: false \(the latents' norms"),
    (dict(disable_bias_linear=False), r"does not take disable_bias_linear: false"),
    (dict(rope_scaling_type="yarn", rope_scaling_factor=4.0), r"does not take YaRN with rope_scaling_mscale other"),
    (dict(multi_latent_attention=False), r"q_lora_rank sizes multi-latent attention, which is off"),
    (dict(spec=["mindspeed_llm.tasks.models.spec.deepseek_spec", "layer_spec"], multi_latent_attention=False),
     r"spec mindspeed_llm.tasks.models.spec.deepseek_spec.layer_spec is the layer with multi_latent_attention"),
    (dict(spec=["mindspeed_llm.tasks.models.spec.minicpm_spec", "layer_spec"]),
     r"spec mindspeed_llm.tasks.models.spec.minicpm_spec.layer_spec names a MindSpeed-LLM layer that mindrl does not "
     r"build yet"),
])
def test_multi_latent_attention_mistakes_are_one_sentence(bad, message):
    values = {k: v for k, v in load_model_arch("tiny_deepseek_v3").__dict__.items() if k != "name"}
    with pytest.raises(ConfigError, match=message):
        ModelArch.from_dict("m", {**values, **bad})


@pytest.mark.parametrize("par, message", [
    (ParallelConfig(3, 1), r"tensor_model_parallel_size=3 does not divide num_attention_heads=4"),
    (ParallelConfig(2, 1, context_parallel_size=4, context_parallel_algo="ulysses_cp_algo"),
     r"ulysses_cp_algo gives each of the TP × CP = 2×4 ranks whole heads, but model tiny_deepseek_v3 has "
     r"num_attention_heads=4"),
])
def test_multi_latent_attention_layouts_that_cannot_be_built_are_one_sentence(par, message):
    with pytest.raises(ConfigError, match=message):
        validate_parallel(load_model_arch("tiny_deepseek_v3"), par)
    odd = dataclasses.replace(load_model_arch("tiny_deepseek_v3"), num_attention_heads=8, q_lora_rank=66)
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=4 does not divide model m's q_lora_rank = 66"):
        validate_parallel(dataclasses.replace(odd, name="m"), ParallelConfig(4, 1))


def test_missing_model_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"no model architecture named 'gpt5'.*tiny_qwen"):
        load_model_arch("gpt5")


@pytest.mark.parametrize("par, world, message", [
    (ParallelConfig(3, 1), None, r"tensor_model_parallel_size=3 does not divide num_attention_heads=4"),
    (ParallelConfig(4, 1), None, r"tensor_model_parallel_size=4 does not divide num_query_groups=2"),
    (ParallelConfig(1, 3), None, r"num_layers=4 .* not divisible by pipeline_model_parallel_size=3"),
    (ParallelConfig(1, 2, num_layer_list="1,2"), None, r"sums to 3 .* num_layers=4"),
    (ParallelConfig(1, 2, num_layer_list="4"), None, r"has 1 entries but pipeline_model_parallel_size=2"),
    (ParallelConfig(1, 2, num_layer_list="0,4"), None, r"empty stage"),
    (ParallelConfig(2, 2), 6, r"world size 6 is not divisible by .* 2×2"),
])
def test_layout_mistakes_get_one_sentence_before_any_process_group(par, world, message):
    arch = load_model_arch("tiny_qwen")
    with pytest.raises(ConfigError, match=message) as err:
        validate_parallel(arch, par, world_size=world)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")
    assert not dist.is_initialized()


def test_bad_layer_list_text():
    with pytest.raises(ConfigError, match="comma-separated integers"):
        ParallelConfig(1, 2, num_layer_list="ten,14")


def test_noop_layers_are_stages_with_fewer_layers():
    """MindSpeed-LLM's Qwen3-235B layout: 94 layers padded to 96 over 16 stages by layers 5 and 95."""
    assert without_noop_layers("5,95", 96, 16) == (94, (5, *[6] * 14, 5))
    assert without_noop_layers([3, 2], 8, 2) == (6, (2, 4))
    assert without_noop_layers("7", 8, 1) == (7, (7,))
    assert without_noop_layers(7, 8, 2) == (7, (4, 3))


@pytest.mark.parametrize("noops, layers, pp, message", [
    ("4,95", 96, 16, r"puts layer 4 inside pipeline stage 0 \(layers 0 to 5\)"),
    ("2", 8, 2, r"puts layer 2 inside pipeline stage 0 \(layers 0 to 3\)"),
    ("96", 96, 16, r"names layer 96, but the model has layers 0 to 95"),
    ("5", 94, 16, r"num_layers=94 is not a multiple of pipeline_model_parallel_size=16"),
    ("0,1", 4, 2, r"leaves pipeline stage 0 without a real layer"),
    ("five", 8, 2, r"noop_layers must be comma-separated integers"),
])
def test_noop_layer_mistakes_are_one_sentence(noops, layers, pp, message):
    with pytest.raises(ConfigError, match=message) as err:
        without_noop_layers(noops, layers, pp)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")


def test_sequence_parallel_has_megatrons_meaning_and_is_refused_where_it_cannot_run():
    dense, moe = load_model_arch("tiny_qwen"), load_model_arch("tiny_qwen3_moe")
    tp2 = [ParallelConfig(2, 1, sequence_parallel=sp) for sp in (None, False, True)]
    assert [par.sequence_parallel_for(dense) for par in tp2] == [False, False, True]
    assert [par.sequence_parallel_for(moe) for par in (tp2[0], tp2[2])] == [True, True]
    # at TP=1 it is off whatever it says, as Megatron turns it off there
    assert not any(ParallelConfig(1, 1, sequence_parallel=True).sequence_parallel_for(a) for a in (dense, moe))
    validate_sequence_parallel(moe, ParallelConfig(1, 1, sequence_parallel=False))
    validate_sequence_parallel(dense, ParallelConfig(1, 1, sequence_parallel=True))
    refused = {
        (moe, ParallelConfig(2, 1, sequence_parallel=False)):
            "sequence_parallel is false, but model tiny_qwen3_moe is a mixture of experts at "
            "tensor_model_parallel_size=2, which megatron-core trains only sequence-parallel; set sequence_parallel "
            "true (or leave it unset), or tensor_model_parallel_size 1.",
        (dataclasses.replace(dense, normalization="LayerNorm"), ParallelConfig(2, 1, sequence_parallel=True)):
            "sequence_parallel needs RMSNorm, but model tiny_qwen uses LayerNorm (torch's module, which megatron-core "
            "does not run sequence-parallel); set sequence_parallel false.",
        (dataclasses.replace(moe, normalization="LayerNorm"), ParallelConfig(2, 1)):
            "model tiny_qwen3_moe is a mixture of experts with LayerNorm: at tensor_model_parallel_size=2 it must run "
            "sequence-parallel, which torch's LayerNorm module does not in megatron-core; use "
            "tensor_model_parallel_size 1.",
        (load_model_arch("tiny_qwen25_vl"), ParallelConfig(2, 1, sequence_parallel=True)):
            "sequence_parallel is not built for vision-language models (model tiny_qwen25_vl: its image features are "
            "placed in the whole sequence's embeddings); set it false.",
    }
    for (arch, par), message in refused.items():
        with pytest.raises(ConfigError) as err:
            validate_sequence_parallel(arch, par)
        assert str(err.value) == message
        validate_parallel(arch, par)  # a converter's or vLLM's layout: never sequence-parallel, not refused so
    validate_sequence_parallel(load_model_arch("tiny_qwen25_vl"), ParallelConfig(2, 1))
    with pytest.raises(ConfigError, match=r"^sequence_parallel must be true or false, got 'yes'\.$"):
        ParallelConfig(2, 1, sequence_parallel="yes")
