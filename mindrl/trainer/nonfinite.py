"""Non-finite numbers in an RL step: where the driver finds them, and how many skipped steps in a row a run takes.

A NaN or inf anywhere upstream of the optimizer ends as NaN weights: Megatron skips an optimizer step whose
gradients are not finite only with a grad scaler, and clipping by a NaN norm leaves the NaN in place. So each
quantity is looked at where it is made, in the step's order: the rewards once scored, the reference's and the
old log-probs after their passes, PPO's values and the advantages once computed, and the loss and gradient norm
inside the update on the ranks (mindrl.workers.megatron_worker). From the first non-finite one on, the step does
nothing more: the update is not run, or its non-finite optimizer steps are skipped on every rank alike. The step
still counts (its prompts are used up, its metrics logged): `actor/skipped_steps` grows by one and a warning
names what went non-finite. More than `rl_config.max_nonfinite_steps` such steps in a row stop the run, since a
cause that persists (a broken verifier, a diverged model) would otherwise run on without learning anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mindrl.config.errors import RunError
from mindrl.console import say

#: the cumulative count of skipped steps, logged every step (Megatron's "number of skipped iterations")
SKIPPED_STEPS = "actor/skipped_steps"


@dataclass(frozen=True)
class NonFinite:
    """What went non-finite in a step: the quantity and where in it."""

    quantity: str
    detail: str

    def __str__(self) -> str:
        return f"{self.quantity} ({self.detail})" if self.detail else self.quantity


def nonfinite(quantity: str, values: torch.Tensor | None) -> NonFinite | None:
    """`values` ([samples] or [samples, tokens]) described where any is NaN or ±inf, None where all are finite
    (or there are none); every position counts, since the losses mask by multiplying and NaN · 0 is NaN."""
    if values is None or not values.is_floating_point():
        return None
    bad = ~torch.isfinite(values)
    if not bad.any():
        return None
    nans, count = int(values.isnan().sum()), int(bad.sum())
    kinds = " and ".join(f"{n} {kind}" for n, kind in ((nans, "NaN"), (count - nans, "inf")) if n)
    rows = bad.reshape(values.shape[0], -1).any(-1)
    return NonFinite(quantity, f"{kinds} in {int(rows.sum())} of {values.shape[0]} samples, the first sample "
                               f"{int(rows.nonzero()[0])}")


def first_nonfinite(quantities: Mapping[str, torch.Tensor | None]) -> NonFinite | None:
    """The first of `quantities` (in their order, the step's) holding a non-finite value."""
    return next((found for name, values in quantities.items() if (found := nonfinite(name, values))), None)


def skipped_update(metrics: Mapping[str, float], role: str) -> NonFinite | None:
    """What made `role`'s update (actor or critic, its renamed metrics) skip an optimizer step: its loss, checked
    before the optimizer, or else its gradients, whose non-finite norm made the optimizer skip."""
    share = metrics.get(f"{role}/skipped", 0.0)
    if not share > 0:
        return None
    what = "loss" if metrics.get(f"{role}/nonfinite_loss", 0.0) > 0 else "gradient norm"
    return NonFinite(f"the {role}'s {what}", f"{share:.0%} of the update's optimizer steps skipped")


class SkippedSteps:
    """Steps skipped for a non-finite number: the run's total and the current run of them in a row, saved with
    checkpoints so that a resumed run counts, and stops, where the uninterrupted one would."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self.in_a_row = 0
        #: the first non-finite step of the current run in a row: (step, what)
        self.first: tuple[int, str] | None = None

    def record(self, step: int, found: NonFinite | None) -> dict[str, float]:
        """Count step `step` (found: what went non-finite, None for a finite step); returns its metric."""
        if found is None:
            self.in_a_row, self.first = 0, None
        else:
            self.total += 1
            self.in_a_row += 1
            self.first = self.first or (step, str(found))
            say(f"warning: step {step}: {found} went non-finite, so the step is skipped ({self.total} skipped so "
                f"far, {self.in_a_row} in a row; more than rl_config.max_nonfinite_steps={self.limit} in a row stop "
                f"the run)")
        return {SKIPPED_STEPS: float(self.total)}

    @property
    def over(self) -> bool:
        """Whether stop_if_over ends the run."""
        return self.in_a_row > self.limit

    def stop_if_over(self, last_checkpoint: str) -> None:
        """After a step is logged: end the run in one sentence once more than `limit` steps in a row were skipped
        (`last_checkpoint` says where a resume would start)."""
        if not self.over:
            return
        step, what = self.first
        raise RunError(f"{what} went non-finite at step {step}, and {self.in_a_row} steps in a row have been "
                       f"skipped for a non-finite number, more than rl_config.max_nonfinite_steps={self.limit} "
                       f"allows; find the cause (a verifier, the reward model, the learning rate or the data), then "
                       f"resume from {last_checkpoint} or raise max_nonfinite_steps.")

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "in_a_row": self.in_a_row, "first": list(self.first) if self.first else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.total, self.in_a_row = int(state["total"]), int(state["in_a_row"])
        self.first = (int(state["first"][0]), str(state["first"][1])) if state["first"] else None
