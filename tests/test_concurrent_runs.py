"""Two users' runs on one machine must not break each other: two tiny GRPO runs whose vLLM engines span two ranks
(infer TP=2, vLLM-CPU's shared-memory communicator), started at the same moment, both finish.

vLLM-CPU named an engine's segments after its group alone, so two engines whose start-ups overlapped (a window of
a fraction of a second here) collided. Whether these two runs' windows overlap is timing; that every engine's
segments carry a name of its own is checked exactly in tests/test_rollout_vllm.py."""

import pytest

from tests import jobs

pytestmark = pytest.mark.job  # two trainer jobs at once


def test_two_runs_with_engines_over_two_ranks_started_together_both_finish(tiny_math_data, tmp_path):
    tokenizer, root = tiny_math_data
    procs = []
    for name in ("first", "second"):
        overrides = jobs.grpo_overrides(tokenizer, root / "eight", tmp_path / name, **{
            "megatron_training.train_iters": 1, "megatron_training.save_interval": 0, "rl_config.test_interval": 0,
            "megatron_training.global_batch_size": 2, "rl_config.mini_batch_size": 2,
            "generate_config.infer_tensor_parallel_size": 2})
        procs.append((jobs.start("train_grpo.py", "grpo_tiny_cpu", overrides, tmp_path / f"{name}.log"),
                      tmp_path / f"{name}.log"))
    for proc, log in procs:
        jobs.finish(proc, log)
    for name in ("first", "second"):
        assert [line["step"] for line in jobs.metrics(tmp_path / name / "metrics.jsonl")] == [1]
