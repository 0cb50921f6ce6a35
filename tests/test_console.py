"""The console shows mindrl's own lines; the run's log keeps everything the processes write, every line; a rank
that raises is one message with its role, rank, node and traceback tail."""

import io
import os
import subprocess
import sys

import pytest

from mindrl.trainer import metrics
from tests import jobs

_REDIRECTED = """
import os, subprocess, sys, warnings
from mindrl.console import error, run_log, say
with run_log(sys.argv[1]):
    say("started")
    print("a library's print")
    warnings.warn("a library's FutureWarning", FutureWarning)
    os.write(2, b"a C library's line on fd 2\\n")
    subprocess.run(["echo", "a child process's line"], check=True)
    error("it went wrong")
print("after the log closed")
"""


def test_everything_a_process_writes_goes_to_the_log_and_mindrls_lines_to_the_terminal_too(tmp_path):
    log = tmp_path / "run" / "run.log"
    done = subprocess.run([sys.executable, "-c", _REDIRECTED, str(log)], capture_output=True, text=True,
                          timeout=jobs.COMMAND_LIMIT_S, cwd=jobs.ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[mindrl] started\nafter the log closed\n"
    assert done.stderr == "error: it went wrong\n"
    kept = log.read_text()
    for line in ("[mindrl] started", "a library's print", "FutureWarning: a library's FutureWarning",
                 "a C library's line on fd 2", "a child process's line", "error: it went wrong"):
        assert line in kept, line
    assert "after the log closed" not in kept


_FAILING_RANK = """
import sys
from mindrl.console import error, run_log
from mindrl.config.errors import RunError
from mindrl.config.resources import RoleResource


class Rank:
    def __init__(self, rank, world_size, device):
        self.rank = rank

    def node(self):
        return "this machine"

    def close(self):
        pass

    def step(self):
        if self.rank == 1:
            def deep(level):
                if level == 0:
                    raise ValueError("the batch had no rows")
                deep(level - 1)
            deep(12)
        return self.rank


with run_log(sys.argv[1]):
    import ray
    from mindrl.trainer.cluster import connect
    from mindrl.workers.group import WorkerGroup

    connect()
    group = WorkerGroup("actor", Rank, RoleResource("CPU", 2))
    group.nodes = group.wait([actor.node.remote() for actor in group.actors])
    try:
        group.call("step")
    except RunError as err:
        error(str(err))
    group.kill()
    ray.shutdown()
"""


@pytest.mark.job
def test_a_rank_that_raises_is_one_message_with_its_role_rank_node_and_traceback_tail(tmp_path):
    log = tmp_path / "run.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", _FAILING_RANK, str(log)], capture_output=True, text=True,
                          timeout=300, cwd=jobs.ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    first, *tail = done.stderr.strip().splitlines()
    assert first == "error: actor rank 1 of 2 on node this machine failed: ValueError: the batch had no rows"
    assert 1 <= len(tail) <= 8 and tail[-1] == "ValueError: the batch had no rows" and "in deep" in tail[-2]
    assert done.stdout == "" and "ray::Rank.step()" not in done.stderr  # the traceback's head is the log's
    kept = log.read_text()
    assert "actor rank 1 of 2 on node this machine failed:\nray::Rank.step()" in kept and "\x1b[" not in kept


def test_off_a_terminal_progress_is_a_plain_line_every_twentieth_of_the_run_or_thirty_seconds(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    console = io.StringIO()
    with metrics.MetricsSink(100, console_file=console) as sink:
        for step in range(1, 101):
            clock[0] += 1.0 if step <= 60 else 40.0  # slow steps at the end: one line each for the time
            sink.log(step, {"grpo/score/mean": 0.5, "timing/all": 1.0})
    steps = [int(line.split()[2].split("/")[0]) for line in console.getvalue().splitlines()]
    assert steps == [*range(5, 61, 5), *range(61, 101)]
    line = console.getvalue().splitlines()[0]
    assert line == "[mindrl] step 5/100 (5%), 1 s/step, ETA 00:01:35, score=0.5 step_s=1"
