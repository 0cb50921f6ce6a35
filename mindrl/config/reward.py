"""Rule-reward keys of `rl_config` (MindSpeed-RL names), validated before anything runs.

`verifier_parallel` and `verifier_timeout` exist in MindSpeed-RL but are never read
there; here they do what their names say. `verifier_fail_score` is mindrl's own: what a
sample scores when its verifier times out or fails (MindSpeed-RL gives 0.0, which is
better than a wrong answer under `acc`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from mindrl.config.errors import ConfigError
from mindrl.config.values import check_types


@dataclass(frozen=True)
class RewardConfig:
    verifier_function: list[str] = field(default_factory=lambda: ["base_acc"])
    verifier_weight: list[float] = field(default_factory=lambda: [1.0])
    #: worker processes that score a batch (always at least one, so that the time limit can kill)
    verifier_parallel: int = 1
    #: seconds one verifier may spend on one sample before it is cut off (scored as a failure, counted)
    verifier_timeout: float = 5.0
    #: score of a timed-out or failed sample, one entry per verifier; null (whole key or entry): its worst score
    verifier_fail_score: list[float | None] | None = None
    overlong_buffer_enable: bool = False
    overlong_buffer: int = 0
    overlong_buffer_penalty_factor: float = 1.0
    rollout_max_tokens: int = 2048

    def __post_init__(self) -> None:
        check_types("", self)  # RLConfig names the section
        if not all(isinstance(name, str) for name in self.verifier_function):
            raise ConfigError(f"verifier_function must be a list of verifier names, got {self.verifier_function!r}.")
        names, weights = list(self.verifier_function), list(self.verifier_weight)
        if not names:
            raise ConfigError("verifier_function is empty; name at least one verifier, e.g. [acc].")
        if len(names) != len(weights):
            raise ConfigError(f"verifier_function has {len(names)} entries but verifier_weight has "
                              f"{len(weights)}; give one weight per verifier.")
        if not all(_is_number(w) for w in weights):
            raise ConfigError(f"verifier_weight must be numbers, got {weights}.")
        if not isinstance(self.verifier_parallel, int) or self.verifier_parallel < 1:
            raise ConfigError(f"verifier_parallel must be an integer >= 1, got {self.verifier_parallel!r}.")
        if not (_is_number(self.verifier_timeout) and 0 < self.verifier_timeout < math.inf):
            raise ConfigError(f"verifier_timeout must be a positive number of seconds, got {self.verifier_timeout!r}.")
        if self.verifier_fail_score is not None:
            if isinstance(self.verifier_fail_score, str) or not isinstance(self.verifier_fail_score, Sequence):
                raise ConfigError(f"verifier_fail_score must be a list with one entry per verifier (null for the "
                                  f"verifier's worst score), got {self.verifier_fail_score!r}.")
            fail_scores = list(self.verifier_fail_score)
            if len(fail_scores) != len(names):
                raise ConfigError(f"verifier_fail_score has {len(fail_scores)} entries but verifier_function has "
                                  f"{len(names)}; give one per verifier (null for the verifier's worst score).")
            if not all(s is None or (_is_number(s) and math.isfinite(s)) for s in fail_scores):
                raise ConfigError(f"verifier_fail_score entries must be finite numbers or null, got {fail_scores}.")
            object.__setattr__(self, "verifier_fail_score", [None if s is None else float(s) for s in fail_scores])
        if self.overlong_buffer_enable:
            if not 0 < self.overlong_buffer < self.rollout_max_tokens:
                raise ConfigError(f"overlong_buffer={self.overlong_buffer} must be between 0 and rollout_max_tokens="
                                  f"{self.rollout_max_tokens} when overlong_buffer_enable is true.")
        object.__setattr__(self, "verifier_function", names)
        object.__setattr__(self, "verifier_weight", [float(w) for w in weights])


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
