"""Step metrics: summaries by hand, and the sink's files read back (TensorBoard, jsonl, resume)."""

import io
import json
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mindrl.rewards.scorer import ScoreResult
from mindrl.trainer.metrics import (
    MetricsSink,
    StepTimer,
    actor_metrics,
    add_round,
    rollout_metrics,
    throughput,
    throughput_metrics,
)


def test_throughput_by_hand():
    # 2 prompts × n=2: mean prompt 10, mean response 30 → 40 tokens × 4 samples / 2 devices / 4 s = 20
    prompts, responses = [8, 8, 12, 12], [20, 40, 30, 30]
    assert throughput(prompts, responses, world_size=2, seconds=4.0) == pytest.approx(20.0)
    # max lengths: (12 + 40) × 4 / 2 / 4 = 26
    assert throughput(prompts, responses, world_size=2, seconds=4.0, use_max=True) == pytest.approx(26.0)
    assert math.isnan(throughput(prompts, responses, 2, 0.0))
    tps = throughput_metrics(prompts, responses, 1, 1, {"all": 8.0, "update": 2.0, "rollout": 4.0, "adv": 1.0})
    assert tps == pytest.approx({"e2e_tps": 20.0, "update_tps": 80.0, "vllm_tps": 40.0,
                                 "e2e_tps_per_actor_device": 20.0})
    assert throughput_metrics(prompts, responses, 1, 1, {"update": 2.0}) == pytest.approx({"update_tps": 80.0})
    # the run holds 4 devices, the actor 1 of them: the throughputs divide by all 4, the per-actor one by 1
    tps = throughput_metrics(prompts, responses, 4, 1, {"all": 8.0, "update": 2.0})
    assert tps == pytest.approx({"e2e_tps": 5.0, "update_tps": 20.0, "e2e_tps_per_actor_device": 20.0})
    with pytest.raises(ValueError, match="3 prompt lengths for 4 responses"):
        throughput(prompts[:3], responses, 1, 1.0)


def test_rollout_metrics_by_hand():
    m = rollout_metrics([4, 16, 10, 16], max_response_length=16, scores=[1.0, -0.5, 0.0, 2.0],
                        verifier_scores={"acc": [1.0, -0.5, -1.0, 1.0], "format": [1.0, 0.0, 0.0, 1.0]})
    assert m == pytest.approx({
        "grpo/score/mean": 0.625, "grpo/score/max": 2.0, "grpo/score/min": -0.5,
        "response_length/mean": 11.5, "response_length/max": 16.0, "response_length/min": 4.0,
        "response_length/clip_ratio": 0.5, "acc_rewards/mean": 0.125, "format_rewards/mean": 0.5,
        "accuracy": 0.5})
    assert "accuracy" not in rollout_metrics([1], 4, [0.0], {"format": [1.0]})
    assert rollout_metrics([1, 2], 4, [0, 1], {"format": [1.0, 0.0]}, accuracy_verifier="format")["accuracy"] == 0.5
    with pytest.raises(ValueError, match="accuracy verifier 'acc' has no scores in this batch"):
        rollout_metrics([1], 4, [0.0], {"format": [1.0]}, accuracy_verifier="acc")


def test_actor_metrics_use_mindspeed_names():
    update = {"pg_loss": 0.1, "kl_loss": 0.2, "entropy": 1.5, "clip_fraction": 0.05, "approx_kl_old": 0.01,
              "lr": 1e-6, "grad_norm": 3.0, "skipped": 0.0, "rollout_is/k3_kl": 1e-7}
    assert actor_metrics(update) == {"actor/pg_loss": 0.1, "actor/kl_loss": 0.2, "actor/entropy": 1.5,
                                     "actor/pg_clipfrac": 0.05, "actor/ppo_kl": 0.01, "actor/lr": 1e-6,
                                     "grad_norm": 3.0, "actor/skipped": 0.0, "rollout_is/k3_kl": 1e-7}


def test_generation_rounds_add_up():
    """DAPO's rounds in one step: seconds, tokens and bytes add, the probe's worst case is the max, the rate is
    recomputed; each round's reward metrics weigh by its samples, and a std pools to the whole's."""
    total: dict[str, float] = {}
    add_round(total, {"rollout/response_tokens": 100.0, "sync/gigabytes": 2.0, "sync/seconds": 1.0,
                      "sync/gb_per_s": 2.0, "sync/probe_max_abs_diff": 3e-6})
    add_round(total, {"rollout/response_tokens": 50.0})
    add_round(total, {"rollout/response_tokens": 10.0, "sync/gigabytes": 2.0, "sync/seconds": 3.0,
                      "sync/gb_per_s": 2 / 3, "sync/probe_max_abs_diff": 1e-6})
    assert total == {"rollout/response_tokens": 160.0, "sync/gigabytes": 4.0, "sync/seconds": 4.0,
                     "sync/gb_per_s": 1.0, "sync/probe_max_abs_diff": 3e-6}
    rounds = [[0.0, 1.0, 1.0], [0.5, -1.0], [2.0, 2.0, 0.0, 1.0]]
    parts = [ScoreResult(r, {"acc": [float(v > 0) for v in r]},
                         {"reward/mean": sum(r) / len(r), "reward_model/mean": sum(r) / len(r),
                          "reward_model/std": float(torch.tensor(r).std(unbiased=False))}) for r in rounds]
    whole = ScoreResult.concatenate(parts)
    flat = torch.tensor([v for r in rounds for v in r], dtype=torch.float64)
    assert whole.rewards == flat.tolist() and whole.scores["acc"] == [float(v > 0) for v in flat]
    assert whole.metrics["reward/mean"] == pytest.approx(flat.mean().item())
    assert whole.metrics["reward_model/std"] == pytest.approx(flat.std(unbiased=False).item(), rel=1e-6)


def test_step_timer_accumulates():
    timer = StepTimer()
    for _ in range(2):
        with timer("rollout"):
            sum(range(1000))
    with timer("all"):
        pass
    metrics = timer.metrics()
    assert set(metrics) == {"timing/rollout", "timing/all"} and metrics["timing/rollout"] > 0


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_scalars(log_dir):
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def step_values(step, run):
    return {"grpo/score/mean": step + run, "timing/all": 0.5 * step}


def test_sink_writes_every_output(tmp_path):
    console = io.StringIO()
    with MetricsSink(train_iters=5, jsonl_path=tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb",
                     console_file=console) as sink:
        for step in (1, 2, 3):
            sink.log(step, {**step_values(step, 0), "actor/pg_loss": math.nan if step == 2 else 0.1})
            # flushed every step: the line is on disk before the sink closes
            assert read_jsonl(tmp_path / "m.jsonl")[-1]["step"] == step
        with pytest.raises(ValueError, match="step 3 comes after step 3 was logged"):
            sink.log(3, {})
    lines = read_jsonl(tmp_path / "m.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert lines[1] == {"step": 2, "grpo/score/mean": 2.0, "timing/all": 1.0, "actor/pg_loss": None}
    scalars = read_scalars(tmp_path / "tb")
    assert scalars["grpo/score/mean"] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert scalars["timing/all"] == [(1, 0.5), (2, 1.0), (3, 1.5)]
    text = console.getvalue()
    assert "3/5" in text and "score=3" in text and "step_s=1.5" in text


def test_resume_redoes_steps_after_the_checkpoint_once(tmp_path):
    jsonl, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    with MetricsSink(5, jsonl, tb, console=False) as sink:
        for step in (1, 2, 3, 4):
            sink.log(step, step_values(step, 0))
    with jsonl.open("a") as f:
        f.write('{"step": 5, "grpo/sc')  # a line cut short by a kill
    # the run had checkpointed at iteration 2: steps 3 and 4 run again with new values
    with MetricsSink(5, jsonl, tb, resume_iteration=2, console=False) as sink:
        for step in (3, 4, 5):
            sink.log(step, step_values(step, 100))
    lines = read_jsonl(jsonl)
    assert [(line["step"], line["grpo/score/mean"]) for line in lines] == [(1, 1), (2, 2), (3, 103), (4, 104),
                                                                           (5, 105)]
    assert read_scalars(tb)["grpo/score/mean"] == [(1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0), (5, 105.0)]


def test_fresh_run_starts_the_files_over(tmp_path):
    jsonl = tmp_path / "m.jsonl"
    with MetricsSink(3, jsonl, console=False) as sink:
        sink.log(1, {"x": 1.0})
    with MetricsSink(3, jsonl, console=False) as sink:
        sink.log(1, {"x": 2.0})
    assert read_jsonl(jsonl) == [{"step": 1, "x": 2.0}]
    with pytest.raises(ValueError, match=r"resume_iteration=4 is outside 0\.\.train_iters=3"):
        MetricsSink(3, jsonl, resume_iteration=4, console=False)
