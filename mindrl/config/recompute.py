"""Activation recompute's settings (Megatron's key names), checked before any worker starts.

Kept apart from the model code (mindrl/models/recompute.py) so a config is judged without loading megatron-core."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mindrl.config.errors import ConfigError

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")


@dataclass(frozen=True)
class Recompute:
    """What a trained model's backward recomputes instead of keeping from its forward: whole layers (`full`: in
    groups of `num_layers` with `uniform`, the first `num_layers` of each pipeline stage with `block`), or the
    attention core only (`selective`); nothing when `granularity` is None."""

    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None

    def check(self, section: str, layers_per_stage: int | None = None) -> None:
        """One sentence per bad or conflicting value, naming the keys."""
        keys = f"{section}.recompute_"
        if self.granularity is None:
            if self.method is not None or self.num_layers is not None:
                raise ConfigError(f"{keys}method / {keys}num_layers choose the layers a full recompute covers, but "
                                  f"{keys}granularity is unset; set it to full or remove them.")
            return
        if self.granularity not in GRANULARITIES:
            raise ConfigError(f"{keys}granularity must be full or selective, got {self.granularity!r}.")
        if self.granularity == "selective":
            if self.method is not None or self.num_layers is not None:
                raise ConfigError(f"{keys}granularity: selective recomputes the attention core of every layer, so "
                                  f"{keys}method and {keys}num_layers (full recompute's) conflict with it; remove "
                                  f"them or set granularity: full.")
            return
        if self.method not in METHODS:
            raise ConfigError(f"{keys}granularity: full needs {keys}method uniform (groups of recompute_num_layers "
                              f"layers) or block (the first recompute_num_layers layers of each stage), got "
                              f"{self.method!r}.")
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ConfigError(f"{keys}granularity: full needs {keys}num_layers, a positive integer, got "
                              f"{self.num_layers!r}.")
        if layers_per_stage is not None and self.num_layers > layers_per_stage:
            raise ConfigError(f"{keys}num_layers={self.num_layers} exceeds the {layers_per_stage} layers of a "
                              f"pipeline stage; lower it to at most {layers_per_stage}.")

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """The TransformerConfig fields: megatron-core's own checkpointing of modules stays off (`recompute_modules`
        empty) because mindrl recomputes with torch's non-reentrant checkpoint (mindrl/models/recompute.py)."""
        if self.granularity is None:
            return {}
        return {"recompute_granularity": self.granularity, "recompute_method": self.method,
                "recompute_num_layers": self.num_layers, "recompute_modules": []}
