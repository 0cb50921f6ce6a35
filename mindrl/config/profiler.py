"""MindSpeed-RL's `profiler_config`: which phases of which steps each rank traces, and what a trace records.

MindSpeed-RL's RL trainers read one role of the section, `integrated` (the actor, reference and rollout's
processes), and silently drop any other; here another role is refused, since its keys would do nothing, and
`integrated` speaks for every rank of the run (a reference, critic or rollout on devices of its own included):
`stage` picks the phases by name, `profile_ranks` the ranks of each role's group.

Steps are the trainer's iterations, counted from 1 as the metrics are: `[profile_step_start, profile_step_end)`
is traced, as in MindSpeed-RL (whose count restarts at 1 in a resumed process; here a resumed run goes on
counting, so a step number always names the same iteration).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mindrl.config.errors import ConfigError
from mindrl.config.keys import Keys, normalise
from mindrl.config.values import check_types
from mindrl.platform.tracing import TraceOptions

#: the one role MindSpeed-RL's GRPO, DAPO and PPO trainers read
ROLE = "integrated"
#: the phases of a step, by MindSpeed-RL's stage names; the critic's are PPO's
PHASES = ("actor_generate", "actor_compute_log_prob", "reference_compute_log_prob", "actor_update")
CRITIC_PHASES = ("critic_compute_values", "critic_update")
LEVELS = ("level_none", "level0", "level1", "level2")
EXPORT_TYPES = ("text", "db")
ALL = "all"


@dataclass(frozen=True)
class ProfilerConfig:
    """One role's keys, MindSpeed-RL's ProfilerConfig; `stage` and `profile_ranks` as given or as tuples."""

    #: the section's role, filled from its name
    role: str = ""
    profile: bool = False
    #: Ascend's lightweight mstx markers (its own profiler only)
    mstx: bool = False
    stage: str | tuple[str, ...] = ALL
    #: empty: `profile/` in actor_config's save folder
    profile_save_path: str = ""
    profile_export_type: str = "text"
    profile_level: str = "level0"
    profile_with_memory: bool = False
    profile_record_shapes: bool = False
    profile_with_cpu: bool = True
    profile_with_npu: bool = True
    profile_with_module: bool = False
    profile_step_start: int = 1
    profile_step_end: int = 2
    profile_analysis: bool = False
    profile_ranks: str | tuple[int, ...] = ALL

    @classmethod
    def from_section(cls, section: Mapping[str, Any] | None, keys: Keys) -> ProfilerConfig:
        """The `integrated` role of a profiler_config section (off when absent); any other role is a key problem."""
        section = normalise(section or {})
        for role in section:
            if role != ROLE:
                keys.problem("profiler_config", f"profiler_config.{role} is not read: mindrl's RL trainers read "
                                                f"profiler_config.{ROLE} alone, as MindSpeed-RL's do, and its `stage` "
                                                f"picks the phases of every role's ranks; move its keys there.", role)
        values = section.get(ROLE) or {}
        name = f"profiler_config.{ROLE}"
        if not isinstance(values, Mapping):
            raise ConfigError(f"{name} must be a mapping of keys, got {values!r}.")
        values = keys.split(name, values, {f.name for f in dataclasses.fields(cls)})
        if values.get("role", ROLE) not in ("", ROLE):
            raise ConfigError(f"{name}.role is filled from the section's name ({ROLE}), but it says "
                              f"{values['role']!r}; remove it.")
        cfg = cls(**{**values, "role": ROLE})
        check_types(name, cfg)
        object.__setattr__(cfg, "stage", _stage(name, cfg.stage))
        object.__setattr__(cfg, "profile_ranks", _ranks(name, cfg.profile_ranks))
        cfg._check(name)
        return cfg

    def _check(self, name: str) -> None:
        if self.profile_level not in LEVELS:
            raise ConfigError(f"{name}.profile_level must be one of {', '.join(LEVELS)}, got {self.profile_level!r}.")
        if self.profile_export_type not in EXPORT_TYPES:
            raise ConfigError(f"{name}.profile_export_type must be text or db, got {self.profile_export_type!r}.")
        if self.profile_step_start < 1:
            raise ConfigError(f"{name}.profile_step_start counts steps from 1, got {self.profile_step_start}.")
        if self.profile_step_end <= self.profile_step_start:
            raise ConfigError(f"{name}.profile_step_end={self.profile_step_end} must be above profile_step_start="
                              f"{self.profile_step_start}: steps [start, end) are traced, so end = start + 1 traces "
                              f"one step.")

    def phases(self, critic: bool, reference: bool) -> tuple[str, ...]:
        """The phases traced, in a step's order; `stage: all` means every phase the run has (the critic's and the
        reference's where it has them)."""
        if self.stage != ALL:
            return tuple(p for p in PHASES + CRITIC_PHASES if p in self.stage)
        return tuple(p for p in PHASES + (CRITIC_PHASES if critic else ())
                     if reference or p != "reference_compute_log_prob")

    def profiles(self, step: int) -> bool:
        return self.profile and self.profile_step_start <= step < self.profile_step_end

    def traces_rank(self, rank: int) -> bool:
        """Whether a rank (its number in its role's group) is traced."""
        return self.profile_ranks == ALL or rank in self.profile_ranks

    @property
    def trace_options(self) -> TraceOptions:
        return TraceOptions(self.profile_with_cpu, self.profile_with_npu, self.profile_record_shapes,
                            self.profile_with_memory, self.profile_with_module, self.profile_level,
                            self.profile_export_type, self.mstx, self.profile_analysis)


def _stage(name: str, stage: Any) -> str | tuple[str, ...]:
    """`all`, or the phases named (one name or a list of them)."""
    names = [stage] if isinstance(stage, str) else stage
    if not isinstance(names, list | tuple) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{name}.stage must be {ALL}, a phase name or a list of them, got {stage!r}.")
    if ALL in names:
        return ALL
    unknown = [n for n in names if n not in PHASES + CRITIC_PHASES]
    if unknown:
        raise ConfigError(f"{name}.stage names {unknown[0]!r}, which is no phase; the phases are {ALL}, "
                          f"{', '.join(PHASES + CRITIC_PHASES)}.")
    return tuple(dict.fromkeys(names))


def _ranks(name: str, ranks: Any) -> str | tuple[int, ...]:
    """`all`, or the ranks named (one number or a list of them)."""
    if ranks == ALL:
        return ALL
    numbers = [ranks] if isinstance(ranks, int) else ranks
    if not isinstance(numbers, list | tuple) or not numbers or \
            not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in numbers):
        raise ConfigError(f"{name}.profile_ranks must be {ALL} or a list of ranks (integers from 0), got {ranks!r}.")
    return tuple(sorted(set(numbers)))
