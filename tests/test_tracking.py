"""Weights & Biases (offline) and SwanLab (local) runs written through MetricsSink, read back from their files with
the trackers' own readers: every scalar of metrics.jsonl at its step, a resume's run replaying the kept steps, no
socket opened to any host and nothing on the console but mindrl's own lines."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mindrl.config import ConfigError
from mindrl.config.keys import Keys
from mindrl.trainer.metrics import METRICS_FILE, MetricsSink
from mindrl.trainer.rl import RLConfig
from mindrl.trainer.sft_config import SFTSection
from mindrl.trainer.tracking import TrackingKeys, open_trackers

ROOT = Path(__file__).resolve().parents[1]


def read_wandb_runs(save: Path) -> list[dict]:
    """Each offline W&B run under `save` (oldest start first, by its folder's time): its run record (None where a
    kill came before W&B wrote it) and its history as (step, values), read from the .wandb transaction log: wandb's
    own records, parsed by the log reader of SwanLab's W&B converter, since wandb itself ships no Python reader."""
    from swanlab.converter.wb.wbdatastore import WBDataStoreReader
    from wandb.proto import wandb_internal_pb2

    runs = []
    for path in (save / "wandb").glob("offline-run-*/run-*.wandb"):
        run, history = None, []
        with WBDataStoreReader() as reader:
            reader.open(path)
            while (data := reader.scan()) is not None:
                record = wandb_internal_pb2.Record()
                record.ParseFromString(data)
                if record.HasField("run"):
                    run = record.run
                elif record.HasField("history"):
                    row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                           for item in record.history.item}
                    history.append((row.pop("_step"), {k: v for k, v in row.items() if not k.startswith("_")}))
        start = (run.start_time.seconds, run.start_time.nanos) if run is not None else (0, 0)
        runs.append({"run": run, "history": history, "order": (path.parent.name.split("-")[2], start)})
    return sorted(runs, key=lambda r: r["order"])


def read_swanlab_runs(save: Path) -> list[dict]:
    """Each local SwanLab run under `save` (oldest start first, by its folder's time): its start record and its
    scalars as (step, values), read with SwanLab's own record reader (the one `swanlab sync` uploads from)."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    runs = []
    for path in (save / "swanlog").glob("run-*/run-*.swanlab"):
        start, steps = None, {}
        reader = DataStoreReader()
        reader.open(path)
        for data in reader:
            record = Record()
            record.ParseFromString(data)
            if record.HasField("start"):
                start = record.start
            elif record.HasField("scalar"):
                steps.setdefault(record.scalar.step, {})[record.scalar.key] = record.scalar.value.number
        reader.close()
        started = (start.started_at.seconds, start.started_at.nanos) if start is not None else (0, 0)
        runs.append({"run": start, "history": sorted(steps.items()),
                     "order": (path.parent.name.split("-")[1], started)})
    return sorted(runs, key=lambda r: r["order"])


READERS = {"wandb": read_wandb_runs, "swanlab": read_swanlab_runs}


def assert_run_holds_the_jsonl(history: list[tuple[int, dict]], jsonl: Path) -> None:
    """Every scalar of metrics.jsonl at its step (null there: a NaN or inf here), each step once, nothing else."""
    steps = [step for step, _ in history]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    logged = dict(history)
    for line in map(json.loads, jsonl.read_text().splitlines()):
        step = line.pop("step")
        assert logged[step].keys() == line.keys(), step
        for key, value in line.items():
            assert not math.isfinite(logged[step][key]) if value is None else logged[step][key] == value, (step, key)
    assert sorted(logged) == [json.loads(line)["step"] for line in jsonl.read_text().splitlines()]


def assert_tracked(save: Path, section: str = "rl_config") -> None:
    """The end-to-end check of a trainer run with `<section>.use_wandb=true` (a stage's section is `section`): its
    newest W&B run under `save` holds every scalar of its metrics.jsonl at its step, and the run's whole config."""
    run = read_wandb_runs(Path(save))[-1]
    assert_run_holds_the_jsonl(run["history"], Path(save) / METRICS_FILE)
    assert section in {item.key for item in run["run"].config.update}


#: the child that runs the sink: any lookup of a host name or connection to an address is recorded (and fails), up to
#: the end of its exit handlers, where the trackers' own last reports would go; their local sockets are allowed
CHILD = """
import atexit, json, socket, sys
attempts = []
atexit.register(lambda: open(sys.argv[3], "w").write(json.dumps(attempts)))  # registered first: runs last
real_connect = socket.socket.connect
def connect(sock, address):
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        attempts.append(repr(address))
        raise OSError("no network in this test")
    return real_connect(sock, address)
def getaddrinfo(host, *args, **kwargs):
    attempts.append(repr(host))
    raise OSError("no network in this test")
socket.socket.connect, socket.getaddrinfo = connect, getaddrinfo
from tests.test_tracking import three_steps_and_a_resume
three_steps_and_a_resume(sys.argv[1], sys.argv[2])
"""
#: the trackers' per-user folders, the test's own (the child gets none of the user's WANDB_* / SWANLAB_* settings)
TRACKER_ENV = ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR", "SWANLAB_ROOT")
CONFIG = {"rl_config": {"n_samples_per_prompt": 4}}


def steps(sink: MetricsSink, first: int, last: int, run: int) -> None:
    for step in range(first, last + 1):
        sink.log(step, {"grpo/score/mean": step + run, "actor/pg_loss": math.nan if step == 2 else 0.1 * step,
                        "actor/kl_loss": math.inf if step == 3 else 0.0, "timing/all": 0.5})


def three_steps_and_a_resume(tracker: str, save: str) -> None:
    """Three steps, then a resume from iteration 2 that runs step 3 again with new values; metrics.jsonl of the first
    start is kept beside the run as first.jsonl."""
    keys = TrackingKeys(**{f"use_{tracker}": True})
    jsonl = Path(save) / METRICS_FILE
    with MetricsSink(3, jsonl, trackers=open_trackers(keys, save, "ray_grpo", CONFIG), console=False) as sink:
        steps(sink, 1, 3, run=0)
    (Path(save).parent / "first.jsonl").write_text(jsonl.read_text())
    with MetricsSink(3, jsonl, resume_iteration=2, console=False,
                     trackers=open_trackers(keys, save, "ray_grpo", CONFIG)) as sink:
        steps(sink, 3, 3, run=100)


@pytest.mark.parametrize("tracker", ["wandb", "swanlab"])
def test_every_step_reaches_the_tracker_and_a_resume_replays_the_kept_steps(tracker, tmp_path):
    save, attempts = tmp_path / "run", tmp_path / "attempts.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("WANDB_", "SWANLAB_"))}
    env.update({name: str(tmp_path / "home" / name.lower()) for name in TRACKER_ENV})
    child = subprocess.run([sys.executable, "-c", CHILD, tracker, str(save), str(attempts)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert json.loads(attempts.read_text()) == [], "a tracker tried the network"
    # nothing on the console but one line per start, naming the run's folder and the command that uploads it
    lines = (child.stdout + child.stderr).splitlines()
    upload = {"wandb": "`wandb sync ", "swanlab": "`swanlab sync "}[tracker]
    assert len(lines) == 2 and all(line.startswith("[mindrl] ") and upload + str(save) in line for line in lines), \
        child.stdout + child.stderr

    first, resumed = READERS[tracker](save)
    assert_run_holds_the_jsonl(first["history"], tmp_path / "first.jsonl")
    assert_run_holds_the_jsonl(resumed["history"], save / METRICS_FILE)
    assert dict(resumed["history"])[3]["grpo/score/mean"] == 103
    assert dict(resumed["history"])[3]["actor/kl_loss"] == math.inf  # inf is kept live; the jsonl's null is NaN
    assert math.isnan(dict(resumed["history"])[2]["actor/pg_loss"])
    for run in (first, resumed):  # the save folder names the run, and the starts of one run share their group
        name, group = ((run["run"].display_name, run["run"].run_group) if tracker == "wandb" else
                       (run["run"].name, run["run"].group))
        assert name == group == save.as_posix() and run["run"].project == "mindrl"
    if tracker == "wandb":
        assert first["run"].telemetry.feature.offline
        assert json.loads({item.key: item.value_json for item in first["run"].config.update}["rl_config"]) == \
            CONFIG["rl_config"]


def test_the_tracker_keys_are_checked_at_config_load():
    resource = {"actor_resource": {"num_cpus": 1}}
    cfg = RLConfig.from_dict({**resource, "use_wandb": True, "wandb_project": "p", "use_swanlab": True,
                              "swanlab_mode": "local"}, Keys())
    assert cfg.use_wandb and cfg.wandb_mode == "offline" and cfg.use_swanlab
    for values, sentence in (
            ({"wandb_mode": "cloud"}, "rl_config.wandb_mode must be offline (files for a later `wandb sync`) or "
                                      "online (needs network and `wandb login`), got 'cloud'."),
            ({"swanlab_mode": "offline"}, "rl_config.swanlab_mode must be local (files for a later `swanlab sync`) "
                                          "or cloud (needs network and `swanlab login`), got 'offline'."),
            ({"wandb_project": "a/b"}, "rl_config.wandb_project='a/b' is no W&B project name"),
            ({"swanlab_project": "a b"}, "rl_config.swanlab_project='a b' is no SwanLab project name"),
            ({"use_wandb": "yes"}, "rl_config.use_wandb must be true or false, got 'yes'.")):
        with pytest.raises(ConfigError) as err:
            RLConfig.from_dict({**resource, **values}, Keys())
        assert str(err.value).startswith(sentence)
    with pytest.raises(ConfigError, match=r"^sft_config\.wandb_mode must be offline"):
        SFTSection.from_dict("sft_config", {"wandb_mode": "on"}, Keys())
    assert SFTSection.from_dict("sft_config", {"use_swanlab": True, "swanlab_mode": "cloud"}, Keys()).use_swanlab
