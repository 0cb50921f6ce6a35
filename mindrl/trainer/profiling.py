"""The driver's side of profiler_config: what the run makes of the section, and the traced steps' calls to the ranks.

The keys are checked against the run before Ray starts: a phase it never runs, a range past its last step, ranks
no group has or a profiler that would record nothing are refused, as they would trace nothing while looking on.
Ascend's own switches (mstx markers, the collection level, db export, its profiler's analysis) mean nothing to
torch.profiler on CPU or GPU, which always records every operator and writes a Chrome trace: set away from their
defaults there, they are named once at start (the traces are still written), not refused, since a MindSpeed-RL
file carries them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mindrl.config import ConfigError
from mindrl.config.keys import Keys
from mindrl.config.profiler import ALL, CRITIC_PHASES, ROLE, ProfilerConfig
from mindrl.console import say
from mindrl.trainer.megatron import MegatronConfig
from mindrl.trainer.rl import RLConfig

if TYPE_CHECKING:
    from mindrl.workers.group import WorkerGroup

_NAME = f"profiler_config.{ROLE}"
#: the roles whose ranks run traced phases (a reward model's do not)
_TRACED_RESOURCES = ("actor_resource", "reference_resource", "critic_resource", "rollout_resource")
#: the Ascend profiler's own keys, at their defaults, and what torch.profiler does instead
_ASCEND_ONLY = {"mstx": (False, "records every operator, not mstx markers alone"),
                "profile_level": ("level0", "has no collection levels and records every operator"),
                "profile_export_type": ("text", "writes Chrome traces (.json), not Ascend's db"),
                "profile_analysis": (False, "writes its traces ready to read, with no analysis to run")}


def run_profiler(section: Mapping[str, Any] | None, keys: Keys, rl: RLConfig,
                 actor: MegatronConfig) -> tuple[ProfilerConfig, list[str]]:
    """The section's `integrated` role checked against this run, its save path resolved (default: `profile/` in the
    actor's save folder); and the notices of keys that do nothing here."""
    cfg = ProfilerConfig.from_section(section, keys)
    if not cfg.profile:
        changed = [f.name for f in dataclasses.fields(cfg)
                   if f.name not in ("role", "profile") and getattr(cfg, f.name) != f.default]
        return cfg, [f"{_NAME} sets {', '.join(changed)} but profile is false, so nothing is traced; set "
                     f"profile: true to trace."] if changed else []
    if cfg.stage != ALL:
        for phase in cfg.stage:
            if phase in CRITIC_PHASES and not rl.trains_critic:
                raise ConfigError(f"{_NAME}.stage names {phase}, a phase of PPO's critic, which adv_estimator "
                                  f"{rl.adv_estimator} does not train; remove it or train with adv_estimator: gae.")
            if phase == "reference_compute_log_prob" and not rl.uses_reference:
                raise ConfigError(f"{_NAME}.stage names reference_compute_log_prob, but no reference runs here "
                                  f"(init_kl_coef is 0, or stage ray_dapo); remove it.")
    device = rl.resources["actor_resource"].kind
    if not cfg.profile_with_cpu and (device == "CPU" or not cfg.profile_with_npu):
        raise ConfigError(f"{_NAME} records neither host nor device activity (profile_with_cpu false"
                          f"{'' if device == 'CPU' else ', profile_with_npu false'}), so its traces would be empty; "
                          f"set profile_with_cpu: true.")
    if actor.train_iters is not None and cfg.profile_step_start > actor.train_iters:
        raise ConfigError(f"{_NAME}.profile_step_start={cfg.profile_step_start} is past train_iters="
                          f"{actor.train_iters}, so nothing would be traced; start within the run.")
    largest = max(rl.resources[key].count for key in _TRACED_RESOURCES if rl.resources[key] is not None)
    if cfg.profile_ranks != ALL and cfg.profile_ranks[-1] >= largest:
        raise ConfigError(f"{_NAME}.profile_ranks names rank {cfg.profile_ranks[-1]}, but the largest group of "
                          f"ranks here has {largest} (ranks 0 to {largest - 1}).")
    path = cfg.profile_save_path or (str(Path(actor.save) / "profile") if actor.save else "")
    if not path:
        raise ConfigError(f"{_NAME}.profile_save_path is empty and actor_config has no save folder to put "
                          f"profile/ in; set one of them.")
    notices = [] if device == "NPU" else [
        f"{_NAME}.{key}={getattr(cfg, key)!r} is Ascend's (its own profiler's); on {device} torch.profiler {what}."
        for key, (default, what) in _ASCEND_ONLY.items() if getattr(cfg, key) != default]
    return dataclasses.replace(cfg, profile_save_path=path), notices


class StepProfiler:
    """Tells every group of ranks, at the start and end of each traced step, which step its calls belong to, and
    says where the traces went; an untraced step calls no rank."""

    def __init__(self, cfg: ProfilerConfig, groups: list[WorkerGroup], rl: RLConfig, on_policy: bool) -> None:
        self.cfg, self.groups, self.phases = cfg, groups, ()
        if not cfg.profile:
            return
        # the ranks' working directory need not be the driver's
        self.cfg = dataclasses.replace(cfg, profile_save_path=str(Path(cfg.profile_save_path).absolute()))
        self.phases = cfg.phases(rl.trains_critic, rl.uses_reference)
        chosen = cfg.profile_ranks
        ranks = "every rank" if chosen == ALL else \
            f"rank{'s' if len(chosen) > 1 else ''} {', '.join(map(str, chosen))}"
        start, end = cfg.profile_step_start, cfg.profile_step_end
        steps = f"step {start}" if end == start + 1 else f"steps {start} to {end - 1}"
        say(f"profiling {', '.join(self.phases)} of {steps} on {ranks} of each role, into "
            f"{self.cfg.profile_save_path}")
        if on_policy and cfg.stage != ALL and "actor_compute_log_prob" in cfg.stage:
            say("warning: actor_compute_log_prob is not traced: this run takes the old log-probs from the update's "
                "own forward (on-policy), so there is no separate pass (actor_update holds it).")

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """The step's calls to the ranks inside, traced where the config selects them."""
        if not self.cfg.profiles(step):
            yield
            return
        for group in self.groups:
            group.call("profile_step", self.cfg, step, self.phases)
        yield
        written = [path for group in self.groups
                   for rank in group.call("profile_step", self.cfg, None, self.phases) for path in rank]
        for folder, count in Counter(str(Path(path).parent) for path in written).items():
            say(f"profile: step {step} {Path(folder).name}: {count} trace{'s' if count > 1 else ''} in {folder}")
