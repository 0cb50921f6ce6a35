"""Weights & Biases and SwanLab beside TensorBoard, under MindSpeed-RL's keys, sending nothing anywhere by default.

Training nodes are often cut off from the internet, where a tracker that waits for its server, asks for a login or
reports its own telemetry would hang the run or fail it. So W&B runs offline and SwanLab keeps its files locally, both
silent on the console; one `[mindrl]` line at start names each tracker's folder and the command that uploads it later
(`wandb sync`, `swanlab sync`). `wandb_mode: online` and `swanlab_mode: cloud` are a user's explicit choice of network.

Each start of a training run is one tracker run. Neither tracker can cut an offline run back to a checkpoint and go on
in it: W&B's rewind (`resume_from`) is a preview of its cloud alone, SwanLab resumes online runs only. So a run resumed
from iteration k opens a new tracker run, and MetricsSink first replays into it the steps ≤ k that metrics.jsonl kept:
the newest tracker run of a save folder holds every step once, with the values TensorBoard shows, while the runs of
earlier starts keep what they logged before they stopped. The starts of one training run share a group (their name).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindrl.config import ConfigError
from mindrl.console import say

WANDB_MODES = ("offline", "online")
#: MindSpeed-RL's swanlab_mode → SwanLab's own mode ('' is local): local keeps the files for a later `swanlab sync`
SWANLAB_MODES = {"": "offline", "local": "offline", "cloud": "online"}
#: the project of a tracker whose `*_project` is empty
DEFAULT_PROJECT = "mindrl"
#: characters W&B refuses in a project name, and SwanLab's rule for one
_WANDB_PROJECT_BANNED = "/\\#?%:"
_SWANLAB_PROJECT = re.compile(r"[0-9a-zA-Z_\-+.]{1,100}")


@dataclass(frozen=True)
class TrackingKeys:
    """The tracker keys rl_config and the SFT/DPO sections share (MindSpeed-RL's, beside use_tensorboard)."""

    use_wandb: bool = False
    wandb_project: str = ""
    wandb_exp_name: str = ""
    wandb_save_dir: str = ""
    #: mindrl's own: offline (the default, files only) or online (needs network and `wandb login`)
    wandb_mode: str = "offline"
    use_swanlab: bool = False
    swanlab_mode: str = ""
    swanlab_project: str = ""
    swanlab_exp_name: str = ""
    swanlab_save_dir: str = ""

    def check_tracking(self, section: str) -> None:
        """Refuse at config load what the trackers would refuse only after the workers started."""
        if self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"{section}.wandb_mode must be offline (files for a later `wandb sync`) or online "
                              f"(needs network and `wandb login`), got {self.wandb_mode!r}.")
        if self.swanlab_mode not in SWANLAB_MODES:
            raise ConfigError(f"{section}.swanlab_mode must be local (files for a later `swanlab sync`) or cloud "
                              f"(needs network and `swanlab login`), got {self.swanlab_mode!r}.")
        banned = sorted(set(self.wandb_project) & set(_WANDB_PROJECT_BANNED))
        if banned or len(self.wandb_project) > 128:
            raise ConfigError(f"{section}.wandb_project={self.wandb_project!r} is no W&B project name (at most 128 "
                              f"characters, none of {_WANDB_PROJECT_BANNED}); rename it.")
        if self.swanlab_project and not _SWANLAB_PROJECT.fullmatch(self.swanlab_project):
            raise ConfigError(f"{section}.swanlab_project={self.swanlab_project!r} is no SwanLab project name (1 to "
                              f"100 letters, digits and _ - + .); rename it.")


def plain_config(value: Any) -> Any:
    """A config of nested dataclasses as JSON-ready dicts and lists, for a tracker's record of the run's settings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_config(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(key): plain_config(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain_config(item) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def default_name(save: str | None, job: str) -> str:
    """A run's name where the keys give none: its save folder (unique per run in practice), else the job."""
    return Path(save).as_posix() if save else job


class WandbTracker:
    """One W&B run: offline unless asked, silent, finished on close."""

    def __init__(self, keys: TrackingKeys, save: str | None, job: str, config: Mapping[str, Any]) -> None:
        if keys.wandb_mode == "offline":
            # offline runs still report wandb's own telemetry to its server unless this is off
            os.environ["WANDB_ERROR_REPORTING"] = "false"
        import wandb

        folder = Path(keys.wandb_save_dir or save or "runs")
        folder.mkdir(parents=True, exist_ok=True)
        name = keys.wandb_exp_name or default_name(save, job)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
        self.run = wandb.init(mode=keys.wandb_mode, project=keys.wandb_project or DEFAULT_PROJECT, name=name,
                              group=name, job_type=job, dir=str(folder), config=dict(config), settings=settings)
        if keys.wandb_mode == "offline":
            run_dir = Path(self.run.dir).parent
            say(f"W&B: offline run in {run_dir}; upload it with `wandb sync {run_dir}`")
        else:
            say(f"W&B: run {self.run.url}")

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()


@contextlib.contextmanager
def _swanlab_quiet() -> Iterator[None]:
    """SwanLab prints its banners with no switch to turn them off; its warnings and errors also go to the debug log
    in its run folder, so nothing is lost."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


class SwanLabTracker:
    """One SwanLab run: local files unless swanlab_mode is cloud, no prompt, no console capture, no host monitor."""

    def __init__(self, keys: TrackingKeys, save: str | None, job: str, config: Mapping[str, Any]) -> None:
        import swanlab

        mode = SWANLAB_MODES[keys.swanlab_mode]
        folder = Path(keys.swanlab_save_dir) if keys.swanlab_save_dir else Path(save or "runs") / "swanlog"
        name = keys.swanlab_exp_name or default_name(save, job)
        # the terminal proxy would copy mindrl's console into the run; the monitor samples this host every 10 s
        settings = swanlab.Settings(interactive=False, terminal=swanlab.Settings.Terminal(proxy_type="none"),
                                    probe=swanlab.Settings.Probe(monitor=False))
        with _swanlab_quiet():
            self.run = swanlab.init(mode=mode, project=keys.swanlab_project or DEFAULT_PROJECT, name=name,
                                    group=name, job_type=job, log_dir=str(folder), config=dict(config),
                                    settings=settings, reinit=True)
        if mode == "offline":
            say(f"SwanLab: local run in {self.run.dir}; upload it with `swanlab sync {self.run.dir}`")
        else:
            say(f"SwanLab: run {self.run.url}")

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        with _swanlab_quiet():
            self.run.finish()


def open_trackers(keys: TrackingKeys, save: str | None, job: str, config: Any) -> list[WandbTracker | SwanLabTracker]:
    """The trackers `keys` turn on, each with `config` (the run's whole composed config) as its record of settings;
    `save` (the run's save folder) holds their files unless the keys name another."""
    record = plain_config(config)
    trackers: list[WandbTracker | SwanLabTracker] = []
    try:
        if keys.use_wandb:
            trackers.append(WandbTracker(keys, save, job, record))
        if keys.use_swanlab:
            trackers.append(SwanLabTracker(keys, save, job, record))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers
