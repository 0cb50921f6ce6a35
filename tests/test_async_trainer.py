"""Asynchronous GRPO end to end (docs/async_rollout.md): the vLLM engine on a CPU of its own, weights pushed after
every update and checked; one-step off-policy resumed after SIGKILL equal to the unbroken run; streaming with
max_staleness 0 equal to the synchronous mode; streaming with partial rollout within its bound — and the
one-sentence refusals before anything starts."""

import itertools
from pathlib import Path

import pytest

from mindrl.checkpoint import megatron as mg
from mindrl.config import ConfigError
from mindrl.trainer.config import load_trainer_config
from tests import jobs

CONFIG = "grpo_tiny_async_cpu"
FP32 = 1e-4
#: 8 prompts (2 steps an epoch) × 4 samples, 32 new tokens, fp32, a checkpoint every step, the engine's weights
#: checked after every push
BASE = {"megatron_training.train_iters": 4, "megatron_training.save_interval": 1, "rl_config.test_interval": 0,
        "rl_config.partial_rollout_max_split": 1, "+generate_config.check_weight_sync": "true"}
#: what varies with the run's own concerns (the machine, and when the push's figures fall)
_TIMED = ("sync/", "async/trainer_wait", "async/trainer_idle", "async/rollout_idle", "rollout/generate_seconds")


def _overrides(data, save: Path, **extra: object) -> list[str]:
    tokenizer, root = data
    return jobs.grpo_overrides(tokenizer, root / "eight", save, **{**BASE, **extra})


def _untimed(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if not k.startswith(_TIMED)} for line in jobs.run_values(lines)]


@pytest.fixture(scope="module")
def one_step_run(tiny_math_data, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("one_step")
    jobs.run("train_grpo.py", CONFIG, _overrides(tiny_math_data, folder / "run",
                                                 **{"rl_config.rollout_mode": "one_step_off_policy"}),
             folder / "log")
    return folder / "run"


@pytest.mark.job
def test_one_step_off_policy_trains_one_version_behind_with_every_push_checked(one_step_run):
    lines = jobs.metrics(one_step_run / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert lines[0]["async/staleness_max"] == 0  # the first batch waits for the first weights
    # its tokens were sampled by the weights it trains: their gap is the engine/trainer mismatch alone (fp32: none),
    # and no behaviour weight applies
    assert lines[0]["rollout_is/abs_log_prob_diff_mean"] <= FP32 and "async/is_weight_mean" not in lines[0]
    for before, line in itertools.pairwise(lines):  # the others generated while the previous batch trained
        assert line["async/staleness_mean"] == 1 and line["async/staleness_max"] == 1, line
        assert line["async/staleness_oldest_token_mean"] == 1 and line["async/off_policy_token_share"] == 1
        # the proximal pass has the update the engine had not: where it moved the weights, the behaviour weight
        # moves off 1 (a batch whose advantages are all 0 leaves them as they were); that gap is staleness, kept out
        # of the engine/trainer mismatch figures (rollout_is/*), which have no fresh token to measure here
        moved = before["grad_norm"] > 0
        assert (line["async/stale_abs_log_prob_diff_mean"] > FP32) == moved, (before, line)
        assert (line["async/is_weight_std"] > 1e-3) == moved
        assert not any(key.startswith("rollout_is/") for key in line)
    assert any(line["grad_norm"] > 0 for line in lines[:-1])
    for line in lines:
        # each push reached the engine: its log-probs of a probe equal the actor's new weights'
        assert line["sync/probe_max_abs_diff"] <= FP32, line
        assert line["async/dropped_groups_total"] == 0


@pytest.mark.job
def test_one_step_sigkill_after_checkpoint_2_then_resume_equals_the_unbroken_run(tiny_math_data, one_step_run,
                                                                                 tmp_path):
    cut, log = tmp_path / "cut", tmp_path / "log"
    overrides = {"rl_config.rollout_mode": "one_step_off_policy"}
    job = jobs.start("train_grpo.py", CONFIG, _overrides(tiny_math_data, cut, **overrides), log)
    jobs.kill_when(job, lambda: (cut / mg.TRACKER).is_file() and mg.read_tracker(cut) == 2, log)
    resumed = mg.read_tracker(cut)
    assert resumed in (2, 3)
    jobs.run("train_grpo.py", CONFIG, _overrides(tiny_math_data, cut, **overrides, **{"actor_config.load": cut}),
             log)
    assert f"at iteration {resumed}" in log.read_text()
    expected, got = jobs.metrics(one_step_run / "metrics.jsonl"), jobs.metrics(cut / "metrics.jsonl")
    assert [line["step"] for line in got] == [1, 2, 3, 4]
    # the buffered batch (generated one version back) came back from the checkpoint: every figure is the same
    assert _untimed(got) == _untimed(expected)


@pytest.mark.job
def test_a_buffered_checkpoint_resumes_only_into_its_shape_or_hands_its_prompts_back(tiny_math_data, one_step_run,
                                                                                     tmp_path):
    """The one-step run's last checkpoint holds the batch generated while the last one trained. Resumed with another
    group shape it is one sentence before any worker starts; resumed without a schedule its prompts come first
    (generated again under the resumed weights): none is lost."""
    from mindrl.trainer.grpo import GRPOTrainer
    from mindrl.trainer.schedule import buffered_rows
    from mindrl.trainer.start import saved_extra

    state = saved_extra(one_step_run, 4)["schedule"]["schedule"]
    assert len(state["groups"]) == 4  # the next batch, generated and waiting
    resume = {"rl_config.rollout_mode": "one_step_off_policy", "actor_config.load": one_step_run,
              "megatron_training.train_iters": 5}
    for change in ({"rl_config.n_samples_per_prompt": 2}, {"megatron_training.global_batch_size": 2,
                                                           "rl_config.mini_batch_size": 2}):
        cfg = load_trainer_config(CONFIG, _overrides(tiny_math_data, tmp_path / "run", **resume, **change))
        with pytest.raises(ConfigError) as err:
            GRPOTrainer(cfg)
        assert "holds 4 buffered groups of 4 samples from batches of 4 prompts" in str(err.value)
        assert "resume with n_samples_per_prompt=4 and global_batch_size=4, which trains them" in str(err.value)
    resume["rl_config.rollout_mode"] = "sync"
    cfg = load_trainer_config(CONFIG, [*_overrides(tiny_math_data, tmp_path / "run", **resume),
                                       "~rl_config.rollout_resource"])
    assert not cfg.rl_config.scheduled
    trainer = GRPOTrainer(cfg)
    assert trainer.handed_back == 4 and trainer.loader.next_rows() == buffered_rows(state)


@pytest.mark.job
def test_streaming_with_max_staleness_0_equals_the_synchronous_mode(tiny_math_data, tmp_path):
    runs = {}
    for mode in ("sync", "streaming"):
        save = tmp_path / mode
        jobs.run("train_grpo.py", CONFIG, _overrides(tiny_math_data, save, **{
            "megatron_training.train_iters": 3, "megatron_training.save_interval": 0, "rl_config.rollout_mode": mode,
            "rl_config.max_staleness": 0}), tmp_path / f"{mode}.log")
        runs[mode] = jobs.metrics(save / "metrics.jsonl")
    assert all(line["async/staleness_max"] == 0 for line in runs["streaming"])
    assert _untimed(runs["streaming"]) == _untimed(runs["sync"])
    # the engines on a CPU of their own at staleness 0: the colocated synchronous objective (rollout_is's weight of
    # the fp32 engine/trainer gap), no behaviour weight
    assert all("async/is_weight_mean" not in line and line["rollout_is/abs_log_prob_diff_mean"] <= FP32
               for line in runs["sync"])


@pytest.mark.job
def test_streaming_partial_rollout_stays_within_the_bound(tiny_math_data, tmp_path):
    """The shipped streaming configuration (max_staleness 2, responses in 4 segments of 8 tokens): every trained
    token within 2 versions, counted by each sample's oldest token, and responses continued across pushes."""
    save = tmp_path / "run"
    jobs.run("train_grpo.py", CONFIG, _overrides(tiny_math_data, save, **{
        "megatron_training.save_interval": 0, "rl_config.partial_rollout_max_split": 4,
        "rl_config.max_staleness": 2, "megatron_training.train_iters": 5}), tmp_path / "log")
    lines = jobs.metrics(save / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    for line in lines:
        assert line["async/staleness_max"] <= 2 and line["async/staleness_oldest_token_mean"] <= 2, line
        assert line["sync/probe_max_abs_diff"] <= FP32, line
        # the fresh tokens' gap is the fp32 engine's mismatch alone; the stale ones' is reported apart
        assert line.get("rollout_is/abs_log_prob_diff_mean", 0.0) <= FP32, line
    assert max(line["async/staleness_max"] for line in lines) >= 1  # responses did span pushes


@pytest.mark.job
def test_partial_rollout_on_the_colocated_megatron_engine(tiny_math_data, tmp_path):
    """MindSpeed-RL's partial rollout in its own placement: the synchronous step on the actor's ranks with the
    Megatron-native engine, responses in 2 segments of 16 tokens, the unfinished ones continued under the next
    update's weights (tokens one version old at most), the engine's log-probs of the fresh ones equal to the actor's."""
    save = tmp_path / "run"
    overrides = _overrides(tiny_math_data, save, **{
        "megatron_training.save_interval": 0, "megatron_training.train_iters": 3, "rl_config.rollout_mode": "sync",
        "rl_config.partial_rollout_max_split": 2, "rl_config.max_staleness": 1,
        "rl_config.actor_resource.num_cpus": 2, "generate_config.backend": "megatron"})
    jobs.run("train_grpo.py", CONFIG, [*overrides, "~rl_config.rollout_resource"], tmp_path / "log")
    lines = jobs.metrics(save / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(line["async/staleness_max"] <= 1 and line["async/dropped_groups_total"] == 0 for line in lines)
    assert lines[0]["async/staleness_max"] == 0
    assert all(line.get("rollout_is/abs_log_prob_diff_mean", 0.0) < FP32 for line in lines)
    assert max(line["async/buffered_groups"] for line in lines) > 0  # unfinished responses waited for a next round


# the refusals: one sentence each, before any worker starts

def _refusal(overrides: list[str], config: str = CONFIG) -> str:
    with pytest.raises(ConfigError) as err:
        load_trainer_config(config, overrides)
    return str(err.value)


def test_the_async_config_loads_as_documented():
    rl = load_trainer_config(CONFIG).rl_config
    assert (rl.rollout_mode, rl.max_staleness, rl.partial_rollout_max_split) == ("streaming", 2, 4)
    assert rl.scheduled and rl.staleness_bound == 2 and rl.resources["rollout_resource"].count == 1
    plain = load_trainer_config("grpo_tiny_cpu").rl_config
    assert not plain.scheduled and plain.staleness_bound == 0


def test_what_the_scheduled_rollout_cannot_run_is_refused():
    assert "rollout_resource" in _refusal(["~rl_config.rollout_resource"])
    assert "backend: vllm" in _refusal(["generate_config.backend=megatron"])
    assert "filter_groups_enable" in _refusal(["+rl_config.filter_groups_enable=true"])
    assert "partial_rollout_max_split" in _refusal(["rl_config.partial_rollout_max_split=300"])
    assert "rollout_mode must be one of" in _refusal(["rl_config.rollout_mode=fully_async"])
    assert "max_staleness" in _refusal(["rl_config.max_staleness=-1"])
    # synchronous partial rollout at bound 0: every segment under the weights its batch trains at (test_schedule.py)
    assert load_trainer_config(CONFIG, ["rl_config.rollout_mode=sync", "~rl_config.rollout_resource",
                                        "rl_config.max_staleness=0"]).rl_config.scheduled


def test_keys_that_do_nothing_here_warn():
    notices = load_trainer_config("grpo_tiny_cpu", ["+rl_config.max_staleness=3",
                                                    "+rl_config.behav_imp_weight_cap=5.0"]).notices
    assert any("max_staleness" in n for n in notices) and any("behav_imp_weight_cap" in n for n in notices)
