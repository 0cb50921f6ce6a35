"""The vision tower of a vision-language model (Qwen2.5-VL), in HF's `vision_config` names.

A model yaml nests it under `vision:`; its presence makes the model a vision-language one, whose
language model rotates by multimodal RoPE (`position_embedding_type: mrope` with `mrope_section`).
The token ids are the tokenizer's: the image placeholder the vision features replace, and the
markers around it that the chat template writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mindrl.config.errors import ConfigError
from mindrl.config.values import check_types


@dataclass(frozen=True)
class VisionArch:
    """Qwen2.5-VL's vision transformer: patches of patch_size² pixels × temporal_patch_size frames, blocks of
    windowed attention (full attention in `fullatt_block_indexes`), and a merger folding each
    spatial_merge_size² patches into one token of the language model's width."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    video_token_id: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    #: pixels across an attention window; blocks outside fullatt_block_indexes attend within windows
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()
    rotary_base: float = 10000.0
    #: HF's video time scale, kept so a converted config.json is the original; images do not use it
    tokens_per_second: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "fullatt_block_indexes", tuple(self.fullatt_block_indexes))
        check_types("model.vision", self)
        for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "temporal_patch_size",
                    "spatial_merge_size", "in_channels", "window_size"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.vision.{key} must be a positive integer, got {getattr(self, key)!r}.")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ConfigError(f"model.vision.hidden_size={self.hidden_size} must split into num_heads={self.num_heads} "
                              f"heads of a width divisible by 4 (the 2-D rotary halves each head twice).")
        bad = [i for i in self.fullatt_block_indexes if not isinstance(i, int) or not 0 <= i < self.depth]
        if bad:
            raise ConfigError(f"model.vision.fullatt_block_indexes has {bad[0]!r}, not a block of depth={self.depth}.")
        if self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ConfigError(f"model.vision.window_size={self.window_size} must be a multiple of patch_size × "
                              f"spatial_merge_size = {self.patch_size * self.spatial_merge_size}.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches folded into one language-model token."""
        return self.spatial_merge_size ** 2

    @property
    def patch_values(self) -> int:
        """Numbers in one flattened patch (channels × frames × rows × columns)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_dict(cls, model: str, values: Mapping[str, Any]) -> VisionArch:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ConfigError(f"model {model}: unknown vision key {unknown[0]!r}; known keys are "
                              f"{', '.join(sorted(fields))}.")
        try:
            return cls(**values)
        except TypeError as err:
            raise ConfigError(f"model {model}: vision: {err}; add the missing keys under vision:.") from None
