"""The SFT trainer's configuration: `megatron_training` (stage sft) and `sft_config`.

`load_sft_config("sft_tiny_cpu", ["megatron_training.train_iters=50"])` composes
configs/sft/<name>.yaml with Hydra (the architecture from configs/model/ through the
defaults list, as for GRPO), refuses unknown keys and checks the layout and batch sizes;
mindrl.trainer.stage's `check_resources` is the one check that needs the machines. All before
Ray starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Formatter

from mindrl.config import ConfigError
from mindrl.config.paths import CONFIGS_DIR
from mindrl.trainer.stage import StageConfig, StageSection

SFT_CONFIGS_DIR = CONFIGS_DIR / "sft"


@dataclass(frozen=True)
class SFTSection(StageSection):
    """`sft_config`: what is taught, and where the ranks run."""

    #: the response taught for each prompt: `{answer}` and the row's extra_info fields (e.g. `{solution}`)
    response_format: str = "{answer}"

    def check(self, name: str) -> None:
        try:
            fields = [field for _, field, _, _ in Formatter().parse(self.response_format)]
        except ValueError as err:
            raise ConfigError(f"{name}.response_format={self.response_format!r} is not a format string ({err}); "
                              f"write fields as {{answer}} and literal braces as {{{{ }}}}.") from None
        if not any(fields):
            raise ConfigError(f"{name}.response_format={self.response_format!r} names no field, so every prompt "
                              f"would be taught the same text; use {{answer}} or an extra_info field.")


@dataclass(frozen=True)
class SFTConfig(StageConfig):
    section: SFTSection

    STAGE = "sft"
    SECTION = "sft_config"
    SECTION_TYPE = SFTSection
    CONFIGS_DIR = SFT_CONFIGS_DIR


def load_sft_config(config_name: str, overrides: Sequence[str] = (),
                    config_dir: str | Path | None = None) -> SFTConfig:
    """configs/sft/<config_name>.yaml (or `config_dir`) with Hydra overrides, checked; raises ConfigError."""
    return SFTConfig.load(config_name, overrides, config_dir)
