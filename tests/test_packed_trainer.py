"""GRPO with padding-free micro-batches cut by token budgets and selective recompute (cli/train_grpo.py, vLLM-CPU
rollouts, PP=2): the update's budget cuts a prompt's samples apart, the engine and the actor still agree, and a job
killed while a checkpoint is being written resumes to the metrics of the uninterrupted run."""

from pathlib import Path

import pytest

from mindrl.checkpoint import megatron as mg
from tests import jobs

pytestmark = pytest.mark.job  # every test here starts a Ray job or a vLLM engine

#: the prompts hold 133-150 tokens and the responses up to 32: an update's micro-batch of 200 tokens takes a
#: prompt and one or two of its samples, the log-prob passes' 400 about two groups
PACKED = {"megatron_training.train_iters": 4, "megatron_training.save_interval": 1,
          "actor_config.pipeline_model_parallel_size": 2, "rl_config.test_interval": 0,
          "rl_config.max_prompt_length": 160, "+rl_config.use_remove_padding": "true",
          "+rl_config.use_dynamic_bsz": "true", "+rl_config.max_packing_token_size": 400,
          "+rl_config.update_max_packing_token_size": 200, "+actor_config.recompute_granularity": "selective"}


def _overrides(tiny_math_data, save: Path, **extra: object) -> list[str]:
    tokenizer, root = tiny_math_data
    return jobs.grpo_overrides(tokenizer, root / "eight", save, **PACKED, **extra)


def test_a_packed_budgeted_run_killed_mid_checkpoint_resumes_to_its_uninterrupted_run(tiny_math_data, tmp_path):
    whole, cut, log = tmp_path / "whole", tmp_path / "cut", tmp_path / "log"
    jobs.run("train_grpo.py", "grpo_tiny_cpu", _overrides(tiny_math_data, whole), log)
    expected = jobs.metrics(whole / "metrics.jsonl")
    assert [line["step"] for line in expected] == [1, 2, 3, 4]
    assert all(line["rollout_is/abs_log_prob_diff_mean"] < 1e-4 for line in expected)  # fp32 engine = packed actor
    assert max(line["grad_norm"] for line in expected) > 0.1
    job = jobs.start("train_grpo.py", "grpo_tiny_cpu", _overrides(tiny_math_data, cut), log)
    jobs.kill_when(job, (cut / f".tmp-{mg.iteration_dir_name(3)}").exists, log)
    assert mg.read_tracker(cut) in (2, 3)
    jobs.run("train_grpo.py", "grpo_tiny_cpu", _overrides(tiny_math_data, cut, **{"actor_config.load": cut}), log)
    got = jobs.metrics(cut / "metrics.jsonl")
    assert [line["step"] for line in got] == [1, 2, 3, 4]
    assert jobs.run_values(got) == jobs.run_values(expected)


def test_the_shrunk_mindspeed_20k_dapo_recipe_trains_three_steps(tiny_math_data, tmp_path):
    """configs/rlxf/dapo_long_tiny_cpu.yaml (MindSpeed-RL's dapo_qwen25_32b_A2_20k with its packing, budget and
    balance keys) on DP2, with shorter responses: three steps, the engine and the balanced packed actor agreeing."""
    tokenizer, root = tiny_math_data
    save = tmp_path / "run"
    jobs.run("train_dapo.py", "dapo_long_tiny_cpu", jobs.shrunk_recipe_overrides(tokenizer, root / "eight", save),
             tmp_path / "log")
    lines = jobs.metrics(save / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(line["rollout_is/abs_log_prob_diff_mean"] < 1e-4 for line in lines)
    assert max(line["grad_norm"] for line in lines) > 0
