"""A worker group's failures: the driver names the rank that caused them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.job

_GROUP_SCRIPT = """
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

    def save(self):
        from mindrl.checkpoint.publish import SaveFailed

        if self.rank == 1:
            raise SaveFailed(SAVE_FAILED)

    def close(self):
        pass


SAVE_FAILED = "saving checkpoint iteration 2 to /ckpt failed on rank 1 (OSError: [Errno 28] No space left on device)"
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
group = WorkerGroup("actor", Rank, RoleResource("CPU", 2))
try:
    group.call(sys.argv[2])
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
    kind, message = _reported(tmp_path, "step")
    assert kind == "lost" and "actor rank 0 of 2" in message and "died" in message, message
    assert "resume it from its last checkpoint" in message


def test_a_ranks_one_sentence_run_error_reaches_the_driver_as_it_is(tmp_path):
    """A failed save is already the sentence for the user (the rank, the OS error, what is intact): the driver
    passes it on, without the 'rank failed' wrapper and traceback lines an unforeseen error gets."""
    kind, message = _reported(tmp_path, "save")
    assert kind == "SaveFailed"
    assert message == "saving checkpoint iteration 2 to /ckpt failed on rank 1 (OSError: [Errno 28] No space left " \
                      "on device)"


def _reported(tmp_path: Path, method: str) -> list[str]:
    """What the driver reports when `method` runs on a group of two ranks that fail as the script says."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    reported = tmp_path / "reported.json"
    done = subprocess.run([sys.executable, "-c", _GROUP_SCRIPT, str(reported), method],
                          capture_output=True, text=True, timeout=300, env={**env, "RAY_AUTH_MODE": "disabled"},
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(reported.read_text())
