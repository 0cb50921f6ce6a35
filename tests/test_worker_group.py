"""A worker group's failures: the driver names the rank that caused them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.job

_ONE_DIES_THE_OTHER_FAILS = """
import json
import os
import signal
import sys
import time

import ray

from mindrl.config.resources import RoleResource
from mindrl.workers.group import WorkerGroup, WorkerLost


class Rank:
    def __init__(self, rank, world_size, device):
        self.rank = rank

    def step(self):
        # rank 1's collective fails as one whose peer has gone; Ray hears of rank 0's death only afterwards
        if self.rank == 1:
            raise RuntimeError("Connection closed by peer")
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    def close(self):
        pass


ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
group = WorkerGroup("actor", Rank, RoleResource("CPU", 2))
try:
    group.call("step")
    reported = ["nothing", ""]
except WorkerLost as err:
    reported = ["lost", str(err)]
except Exception as err:
    reported = [type(err).__name__, str(err)]
with open(sys.argv[1], "w") as out:  # Ray's own lines may follow on stdout
    json.dump(reported, out)
group.kill()
ray.shutdown()
"""


def test_a_ranks_death_is_reported_over_the_error_another_rank_raised_because_of_it(tmp_path):
    """A killed rank makes its peers' collectives fail at once, and Ray may deliver their errors first: the run
    must still say which rank died and how to resume, not blame a peer's 'connection closed'."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    reported = tmp_path / "reported.json"
    done = subprocess.run([sys.executable, "-c", _ONE_DIES_THE_OTHER_FAILS, str(reported)], capture_output=True,
                          text=True, timeout=300, env={**env, "RAY_AUTH_MODE": "disabled"},
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    kind, message = json.loads(reported.read_text())
    assert kind == "lost" and "actor rank 0 of 2" in message and "died" in message, message
    assert "resume it from its last checkpoint" in message
