"""LoRA's settings (MindSpeed-RL's key names), checked before any worker starts.

Kept apart from the model code (mindrl/models/lora.py) so a config is judged without loading megatron-core."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mindrl.config.errors import ConfigError

#: the Megatron linear layers an adapter can sit on (a mixture of experts' experts' fc1 / fc2 included)
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
#: PEFT's module names on an HF model → the Megatron layer that holds them (a user's first guess at the key)
HF_NAMES = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
            "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}


@dataclass(frozen=True)
class LoraConfig:
    """Adapters W + (alpha / r)·B·A on the named linear layers; none at all when `target_modules` is empty."""

    target_modules: tuple[str, ...] = ()
    r: int = 8
    alpha: float = 16.0
    #: checkpoints hold the adapters (and their optimizer state) only; the base is the run's initial weights
    ckpt_filter: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.target_modules)

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def check(self, section: str) -> None:
        """One sentence per bad value, naming the key."""
        unknown = [m for m in self.target_modules if m not in TARGETS]
        if unknown:
            hint = "".join(f"; HF's {m} is {HF_NAMES[m]} here" for m in unknown if m in HF_NAMES)
            raise ConfigError(f"{section}.lora_target_modules names {', '.join(map(repr, unknown))}, which mindrl's "
                              f"Megatron model does not have; pick from {', '.join(TARGETS)}{hint}.")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ConfigError(f"{section}.lora_target_modules lists a module twice ({list(self.target_modules)}); "
                              f"name each once.")
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ConfigError(f"{section}.lora_r must be a positive integer, got {self.r!r}.")
        if not self.alpha > 0:
            raise ConfigError(f"{section}.lora_alpha must be positive, got {self.alpha!r}.")
        if self.ckpt_filter and not self.enabled:
            raise ConfigError(f"{section}.lora_ckpt_filter is set but there are no adapters to keep; set "
                              f"lora_target_modules or remove lora_ckpt_filter.")

    @staticmethod
    def no_base(root: object) -> str:
        """The sentence for a run asked to start from an adapters-only checkpoint: its base is not in it."""
        return (f"{root} holds LoRA adapters without their base weights, so a run cannot start from it; resume it "
                f"with the job and base that wrote it, or export merged weights (cli/convert_ckpt.py mg -> hf) and "
                f"convert those back to start from.")

    def resume_mismatch(self, saved: Mapping[str, Any] | None) -> str | None:
        """Where a checkpoint's LoRA record (None: it has no adapters) differs from these settings, the rest of a
        sentence saying so and what to set; None where a resume fits them."""
        def settings(r: int, alpha: float, modules: Sequence[str]) -> tuple:
            return r, float(alpha), sorted(modules)

        def words(found: tuple | None) -> str:
            return f"LoRA r={found[0]} alpha={found[1]:g} on {', '.join(found[2])}" if found else "no adapters"

        mine = settings(self.r, self.alpha, self.target_modules) if self.enabled else None
        theirs = settings(saved["r"], saved["alpha"], saved["target_modules"]) if saved else None
        if mine == theirs:
            return None
        trained = f"was trained with {words(theirs)} but the model has {words(mine)}"
        if theirs is None:
            return f"{trained}; set finetune: true to start the adapters on its weights at step 0."
        same = "set lora_target_modules, lora_r and lora_alpha as the checkpoint's"
        if saved["adapters_only"]:
            return f"{trained}; {same} (an adapters-only checkpoint resumes with them only)."
        return f"{trained}; {same}, or finetune: true to start from its merged weights at step 0."
