"""The scheduled rollout: the rounds of mindrl/trainer/schedule.py run on the engines, beside the actor's updates.

Modes (rl_config.rollout_mode, docs/async_rollout.md):
- sync with the engines on their own devices (rollout_resource) or with partial rollout: each step's batch is
  generated under the step's weights (partial rollout: unfinished responses carry on in the next step's round);
- one_step_off_policy: batch k + 1 generates, with the weights of step k − 1's update, while batch k trains; the
  round starts before the update and is collected after it, then the update's weights are pushed;
- streaming: rounds run back to back while the actor trains; at a push the round in flight is the last under the
  old weights (a partial rollout's abort point), and its unfinished responses go on under the new ones.

Every round is one engine call with one request per sample (the prompt plus its response so far, n = 1), its
seeds those of the round's count (`sampling_for_step`), so a run is reproducible wherever its rounds are (sync,
one-step: always; streaming: where the timings fall alike). A checkpoint holds the schedule (every buffered
sample, its tokens, log-probs and versions) and the round count; the engines hold the checkpoint's weights again
(the resumed iteration's version) once `start` has pushed them, so a resumed run continues exactly: no sample
trained twice or skipped, and the bound holds across the restart.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mindrl.rollout.base import RolloutResult
from mindrl.rollout.config import SamplingConfig, sampling_for_step
from mindrl.trainer.metrics import StepTimer, add_round
from mindrl.trainer.schedule import Group, Request, Schedule

#: seconds between looks at a streaming round while the actor's update runs
POLL_S = 0.02


class ScheduledRollout:
    """The driver's side of the rollout: which groups generate when, on which engines, under which version."""

    def __init__(self, loader: Any, n: int, batch_groups: int, sampling: SamplingConfig, mode: str,
                 max_staleness: int, max_split: int, actor: Any, role: Any = None, check: bool = False) -> None:
        self.loader, self.sampling, self.mode = loader, sampling, mode
        self.schedule = Schedule(n, batch_groups, sampling.max_tokens, max_staleness, max_split)
        #: the actor's worker group (rounds run there without a rollout role) and the engines' own role, if any
        self.actor, self.role = actor, role
        #: compare the engines' log-probs of a probe with the actor's after every push (check_weight_sync)
        self.check = check
        #: rounds launched since the run started (their seeds), and the version the engines hold
        self.rounds = 0
        self.engine_version = 0
        self._flight: tuple[list[Request], Any, int] | None = None
        #: this step's rounds' metrics, and the seconds the trainer waited for its groups
        self._metrics: dict[str, float] = {}
        self.waited = 0.0

    def start(self, version: int) -> dict[str, float]:
        """The engines take the weights the run starts (or resumes) from."""
        self.engine_version = version
        return self._push(version) if self.role is not None else {}

    def _push(self, version: int) -> dict[str, float]:
        metrics = self.role.push(version)
        if self.check:
            metrics.update(self.role.check())
        return metrics

    # ---------------------------------------------------------------- rounds
    def _launch(self, version: int) -> bool:
        """Start a round (admitting one batch of prompts if the bound has room); False when nothing is left to
        generate."""
        schedule = self.schedule
        if schedule.room(version) >= schedule.batch_groups:
            rows = self.loader.next_rows()
            schedule.admit((row, self.loader.prompts[row].ids) for row in rows)
        requests = schedule.requests()
        if not requests:
            return False
        self.rounds += 1
        sampling = sampling_for_step(self.sampling, self.rounds)
        prompts = [r.ids for r in requests]
        images = self._images(requests)
        # whole responses need no per-request budget (an agent loop budgets its own turns)
        caps = [r.max_tokens for r in requests]
        caps = None if all(cap == self.sampling.max_tokens for cap in caps) else caps
        if self.role is not None:
            pending = self.role.generate_async(prompts, 1, sampling, images, caps)
        else:  # colocated: the actor's ranks generate now (the engine syncs the actor's weights first)
            pending = self.actor.call("generate", prompts, 1, sampling, images, caps, phase="rollout")[0]
        self._flight = (requests, pending, self.engine_version)
        return True

    def _images(self, requests: list[Request]) -> list | None:
        images = [self.loader.prompts[self.schedule.groups[r.group].row].images for r in requests]
        return images if any(i is not None for i in images) else None

    def _collect(self) -> None:
        """Wait for the round in flight and add its segments."""
        requests, pending, version = self._flight
        self._flight = None
        result, metrics = self.role.wait(pending) if self.role is not None else pending
        made_by = metrics.pop("rollout/weight_version", version)
        if made_by != version:  # a push that never took effect would otherwise train under the wrong versions
            raise RuntimeError(f"the engines generated a round with policy version {made_by:g} where the driver had "
                               f"pushed version {version}; a weight push did not take effect.")
        add_round(self._metrics, metrics)
        self.schedule.add(requests, result, version)

    def _round_done(self) -> bool:
        return self._flight is not None and (self.role is None or ready(self._flight[1].refs))

    # ---------------------------------------------------------------- the step
    def batch(self, version: int, timer: StepTimer) -> list[Group]:
        """The groups to train at `version` (the step's rollout metrics come with `after_update`)."""
        start = time.perf_counter()
        with timer("rollout"):
            while (groups := self.schedule.take(version)) is None:
                if self._flight is None and not self._launch(version):
                    raise RuntimeError("the schedule has nothing to generate and no batch to train: a bug in "
                                       "mindrl/trainer/schedule.py's admission")
                self._collect()
            if self.mode != "sync":  # the next round runs while this batch trains
                self._launch(version)
        self.waited += time.perf_counter() - start
        return groups

    def while_updating(self, pending: Any, done: Any, version: int) -> None:
        """Streaming: rounds back to back until the update (`pending`, `done(pending)` says when it is) ends."""
        if self.mode != "streaming" or self.role is None:
            return
        while not done(pending):
            if self._round_done():
                self._collect()
            if self._flight is None and self._launch(version):
                continue
            time.sleep(POLL_S)

    def after_update(self, version: int) -> dict[str, float]:
        """The round in flight ends under the old weights, the new ones (`version`) reach the engines; returns the
        step's rollout, push and wait metrics."""
        start = time.perf_counter()
        if self._flight is not None:
            self._collect()
        metrics = dict(self._metrics)
        metrics["async/trainer_wait_seconds"] = self.waited + time.perf_counter() - start
        if self.role is not None:
            metrics.update(self._push(version))
        # a colocated engine syncs the actor's weights at its next round by itself
        self.engine_version = version
        metrics["async/dropped_groups_total"] = float(self.schedule.dropped)
        metrics["async/buffered_groups"] = float(len(self.schedule.groups))
        self._metrics, self.waited = {}, 0.0
        return metrics

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                 images: list | None) -> RolloutResult:
        """A generation outside the schedule (validation) on the engines' own devices, which hold the weights of the
        last push."""
        return self.role.wait(self.role.generate_async(prompts, n, sampling, images, None))[0]

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.state_dict(), "rounds": self.rounds}

    def resume_unscheduled(self, iteration: int, rounds: int) -> None:
        """Go on from `iteration` steps of whole batches and nothing buffered (a synchronous run's checkpoint, or a
        scheduled one whose shape changed when its buffer was empty): admissions follow the steps, seeds `rounds`."""
        self.rounds = rounds
        self.schedule.admitted = iteration * self.schedule.batch_groups

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state["schedule"])
        self.rounds = int(state["rounds"])


def ready(refs: list[Any]) -> bool:
    """Whether every rank of a call has answered (a failed rank counts: waiting for it raises its error)."""
    import ray

    return not ray.wait(list(refs), num_returns=len(refs), timeout=0)[1]


def token_versions(versions: list[list[int]], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each response token's policy version (`schedule.batch_of`'s, per row) at the batch's log-prob positions (those
    of `loss_mask`), -1 elsewhere."""
    out = torch.full(batch["loss_mask"].shape, -1, dtype=torch.long)
    for row, (length, row_versions) in enumerate(zip(batch["prompt_lengths"].tolist(), versions, strict=True)):
        out[row, length - 1:length - 1 + len(row_versions)] = torch.tensor(row_versions, dtype=torch.long)
    return out
