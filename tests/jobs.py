"""Running a mindrl command as a job in its own session, and ending all of it.

Each job runs in its own session so that a SIGKILL can reach all of it — the driver, the
Ray processes it started and their workers — by the PIDs of that session alone.
"""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOB_LIMIT_S = 600
#: a short command's hang guard, not its expected time: on a loaded two-core machine a 2 s conversion ran past 120 s
COMMAND_LIMIT_S = 600
# Metrics that measure the machine rather than the run: they differ between any two runs.
_MACHINE = ("timing/", "_tps", "seconds", "gb_per_s", "tokens_per_s")


#: why jobs may not start in this session (the quick tier), or None
_refused: str | None = None


def stage_of(config_name: str) -> str:
    """The stage a shipped trainer config's name announces (ppo_*, dapo_*, else GRPO): the command that runs it."""
    return {"ppo": "ray_ppo", "dapo": "ray_dapo", "dpo": "dpo", "sft": "sft"}.get(config_name.split("_")[0], "ray_grpo")


def refuse(reason: str) -> None:
    """From now on, starting a job or an evaluation fails, naming the mark the test lacks."""
    global _refused
    _refused = reason


def _check_allowed(what: str) -> None:
    if _refused is not None:
        raise RuntimeError(f"{_refused}, but this test starts {what}; mark it @pytest.mark.job")


def start(script: str, config_name: str, overrides: list[str], log: Path) -> subprocess.Popen:
    """`python cli/<script> --config-name <config_name> <overrides>`, output appended to `log`."""
    _check_allowed(f"cli/{script}")
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, str(ROOT / "cli" / script), "--config-name", config_name,
                                 *overrides], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)


def session_pids(sid: int) -> list[int]:
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


def kill_session(proc: subprocess.Popen) -> None:
    for pid in session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def finish(proc: subprocess.Popen, log: Path, status: int = 0) -> None:
    """Wait for a job to end with `status` (0: success) and check that none of its processes outlive it."""
    try:
        code = proc.wait(timeout=JOB_LIMIT_S)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        pytest.fail(f"the job ran past {JOB_LIMIT_S} s:\n{log.read_text()[-4000:]}")
    assert code == status, log.read_text()[-6000:]
    deadline = time.monotonic() + 30
    while session_pids(proc.pid) and time.monotonic() < deadline:  # Ray's processes leave shortly after the driver
        time.sleep(0.5)
    left = session_pids(proc.pid)
    kill_session(proc)
    assert not left, f"processes {left} of the job outlived it"


def grpo_overrides(tokenizer: Path, data_path: Path, save: Path, **extra: object) -> list[str]:
    """grpo_tiny_cpu's overrides for short runs in fp32 on every CPU (bf16: auto would pick bf16 on some): the
    engine and the actor then agree to fp32 rounding, which the GRPO tests check."""
    values = {"megatron_training.tokenizer_name_or_path": tokenizer, "megatron_training.data_path": data_path,
              "megatron_training.bf16": "false",
              "megatron_training.save": save, "rl_config.tensorboard_dir": save / "tb",
              "generate_config.sampling_config.max_tokens": 32, "rl_config.rollout_max_tokens": 32,
              "rl_config.overlong_buffer": 16, "generate_config.max_num_seqs": 32, **extra}
    return [f"{key}={value}" for key, value in values.items()]


def shrunk_recipe_overrides(tokenizer: Path, data_path: Path, save: Path, **extra: object) -> list[str]:
    """A shrunk MindSpeed-RL recipe's overrides for a three-step run in fp32 with 64-token responses (and the overlong
    buffer scaled with them), saving nothing but its metrics."""
    values = {"megatron_training.tokenizer_name_or_path": tokenizer, "megatron_training.data_path": data_path,
              "megatron_training.bf16": "false", "megatron_training.save": save, "megatron_training.train_iters": 3,
              "megatron_training.save_interval": 0, "rl_config.tensorboard_dir": save / "tb",
              "generate_config.sampling_config.max_tokens": 64, "rl_config.rollout_max_tokens": 64,
              "rl_config.overlong_buffer": 16, **extra}
    return [f"{key}={value}" for key, value in values.items()]


def run(script: str, config_name: str, overrides: list[str], log: Path, status: int = 0) -> None:
    finish(start(script, config_name, overrides, log), log, status)


def kill_when(proc: subprocess.Popen, ready, log: Path, delay_s: float = 0.0) -> None:
    deadline = time.monotonic() + JOB_LIMIT_S
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_session(proc)
            pytest.fail(f"the job ended or stalled before the kill point:\n{log.read_text()[-6000:]}")
        time.sleep(0.001)
    time.sleep(delay_s)
    kill_session(proc)


def kill_rank_when(proc: subprocess.Popen, ready, title: str, log: Path, delay_s: float = 0.0,
                   limit_s: float = 120.0, sig: int = signal.SIGKILL, poll_s: float = 0.001) -> tuple[int, float]:
    """Send `sig` (SIGKILL; SIGSTOP to hang it) to one process of the job whose title starts with `title` (a Ray
    actor, e.g. "ray::PolicyRank"; "ray::PolicyRank.update" while it runs that method) once `ready()`, looked at
    every `poll_s`, and let the job end on its own: (its exit status, seconds from the signal to its end)."""
    deadline = time.monotonic() + JOB_LIMIT_S
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_session(proc)
            pytest.fail(f"the job ended or stalled before the kill point:\n{log.read_text()[-6000:]}")
        time.sleep(poll_s)
    time.sleep(delay_s)
    ranks = titled(proc, title)
    if not ranks:
        kill_session(proc)
        pytest.fail(f"no process titled {title!r} in the job:\n{log.read_text()[-4000:]}")
    os.kill(ranks[0], sig)
    killed = time.monotonic()
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        pytest.fail(f"the job did not end within {limit_s:.0f} s of losing a rank:\n{log.read_text()[-4000:]}")
    seconds = time.monotonic() - killed
    deadline = time.monotonic() + 30
    while session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = session_pids(proc.pid)
    kill_session(proc)
    assert not left, f"processes {left} of the job outlived it"
    return code, seconds


def titled(proc: subprocess.Popen, title: str) -> list[int]:
    """The job's processes whose title (command line) starts with `title`."""
    return [pid for pid in session_pids(proc.pid) if _cmdline(pid).startswith(title)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_values(lines: list[dict]) -> list[dict]:
    """Each step's metrics without those that measure the machine."""
    return [{k: v for k, v in line.items() if not any(m in k for m in _MACHINE)} for line in lines]


def evaluate(*args: str | Path) -> dict:
    """cli/evaluate.py's JSON summary line, from its entry point in this process (run from the checkout, as a
    command would be): its ranks fork from the test session's rank server, already warm, instead of a new
    command's. The demo's test runs the command itself as a process."""
    from cli.evaluate import main

    _check_allowed("cli/evaluate.py")
    printed = io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(printed):
        code = main([str(arg) for arg in args])
    assert code == 0, f"cli/evaluate.py {' '.join(map(str, args))} exited with {code}"
    return json.loads(printed.getvalue().strip().splitlines()[-1])
