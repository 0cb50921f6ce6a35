"""A rank's side of profiler_config: which of its calls are traced, and under which name.

The driver tells each rank at the start of a traced step which step the following calls belong to, and at its end
collects what was written (`profile_step`); in between, each phase's call on a rank runs inside `traced(phase)`,
which starts a profiler only for a phase, step and rank the config selects. Outside traced steps a rank holds no
profiling state at all, so an untraced call pays one attribute test.

A trace is `<profile_save_path>/step<N>/<phase>/rank<r>.json` (a folder `rank<r>/` on NPU); a phase called more
than once in a step (DAPO's rollout rounds) adds `rank<r>-2`, `rank<r>-3`, … in the order of the calls.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from mindrl.config.profiler import ProfilerConfig
from mindrl.platform.tracing import trace

#: the context of every call outside a traced phase, step and rank
_UNTRACED = contextlib.nullcontext()


class StepTracing:
    """One traced step on one rank: the phases to trace, and the traces written so far."""

    def __init__(self, cfg: ProfilerConfig, step: int, rank: int, platform: str, phases: tuple[str, ...]) -> None:
        self.cfg, self.step, self.rank, self.platform, self.phases = cfg, step, rank, platform, phases
        self.calls: Counter[str] = Counter()
        self.written: list[str] = []

    @contextlib.contextmanager
    def trace(self, phase: str) -> Iterator[None]:
        self.calls[phase] += 1
        count = self.calls[phase]
        name = f"rank{self.rank}" if count == 1 else f"rank{self.rank}-{count}"
        stem = Path(self.cfg.profile_save_path) / f"step{self.step}" / phase / name
        with trace(self.platform, self.cfg.trace_options, stem) as path:
            yield
        self.written.append(str(path))


class PhaseTracing:
    """Mixed into every rank (its `rank` in the role's group, its `device` kind)."""

    rank: int
    device: str
    _tracing: StepTracing | None = None

    def profile_step(self, cfg: ProfilerConfig, step: int | None, phases: tuple[str, ...]) -> list[str]:
        """Trace `phases` of the calls that follow as step `step` (None: trace nothing from now on); returns the
        traces this rank wrote since the last call."""
        written = self._tracing.written if self._tracing is not None else []
        self._tracing = None
        if step is not None and cfg.traces_rank(self.rank):
            self._tracing = StepTracing(cfg, step, self.rank, self.device, phases)
        return written

    def traced(self, phase: str) -> contextlib.AbstractContextManager:
        """The context a phase's call runs in: a profiler where this step traces it on this rank."""
        tracing = self._tracing
        if tracing is None or phase not in tracing.phases:
            return _UNTRACED
        return tracing.trace(phase)
