"""Rule-reward keys of `rl_config` (MindSpeed-RL names), validated before anything runs.

`verifier_parallel` and `verifier_timeout` exist in MindSpeed-RL but are never read
there; here they do what their names say.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mindrl.config.errors import ConfigError


@dataclass(frozen=True)
class RewardConfig:
    verifier_function: list[str] = field(default_factory=lambda: ["base_acc"])
    verifier_weight: list[float] = field(default_factory=lambda: [1.0])
    #: processes that score a batch; 1 scores in the calling process
    verifier_parallel: int = 1
    #: seconds one verifier may spend on one sample before it scores 0 (counted as a timeout)
    verifier_timeout: float = 5.0
    overlong_buffer_enable: bool = False
    overlong_buffer: int = 0
    overlong_buffer_penalty_factor: float = 1.0
    rollout_max_tokens: int = 2048

    def __post_init__(self) -> None:
        names, weights = list(self.verifier_function), list(self.verifier_weight)
        if not names:
            raise ConfigError("verifier_function is empty; name at least one verifier, e.g. [acc].")
        if len(names) != len(weights):
            raise ConfigError(f"verifier_function has {len(names)} entries but verifier_weight has "
                              f"{len(weights)}; give one weight per verifier.")
        if not all(isinstance(w, int | float) and not isinstance(w, bool) for w in weights):
            raise ConfigError(f"verifier_weight must be numbers, got {weights}.")
        if not isinstance(self.verifier_parallel, int) or self.verifier_parallel < 1:
            raise ConfigError(f"verifier_parallel must be an integer >= 1, got {self.verifier_parallel!r}.")
        if not self.verifier_timeout > 0:
            raise ConfigError(f"verifier_timeout must be a positive number of seconds, got {self.verifier_timeout!r}.")
        if self.overlong_buffer_enable:
            if not 0 < self.overlong_buffer < self.rollout_max_tokens:
                raise ConfigError(f"overlong_buffer={self.overlong_buffer} must be between 0 and rollout_max_tokens="
                                  f"{self.rollout_max_tokens} when overlong_buffer_enable is true.")
        object.__setattr__(self, "verifier_function", names)
        object.__setattr__(self, "verifier_weight", [float(w) for w in weights])
