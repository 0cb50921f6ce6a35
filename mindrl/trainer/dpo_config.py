"""The DPO trainer's configuration: `megatron_training` (stage dpo) and `dpo_config`.

`load_dpo_config("dpo_facts_cpu", ["dpo_config.dpo_beta=0.2"])` composes configs/dpo/<name>.yaml with Hydra,
refuses unknown keys and checks the layout, batch sizes and loss settings before Ray starts. Key names are
MindSpeed-LLM's and TRL's: `dpo_beta`, `dpo_loss_type`, `dpo_label_smoothing`, `rpo_alpha`, `ref_model`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mindrl.algorithms.dpo_loss import DPOLossConfig
from mindrl.config import ConfigError
from mindrl.config.paths import CONFIGS_DIR
from mindrl.config.values import positive
from mindrl.trainer.stage import StageConfig, StageSection

DPO_CONFIGS_DIR = CONFIGS_DIR / "dpo"


@dataclass(frozen=True)
class DPOSection(StageSection):
    """`dpo_config`: the preference loss, the reference, and where the ranks run."""

    #: sigmoid (DPO), robust, hinge or ipo (mindrl.algorithms.dpo_loss)
    dpo_loss_type: str = "sigmoid"
    dpo_beta: float = 0.1
    #: the share of pairs assumed mislabelled (conservative / robust DPO); 0 for plain DPO
    dpo_label_smoothing: float = 0.0
    #: weight of the chosen responses' NLL per token added to the loss (RPO, older TRL's `rpo_alpha`); 0: plain DPO
    rpo_alpha: float = 0.0
    #: a Megatron checkpoint root of the frozen reference, in the actor's layout; unset: the weights DPO starts from
    ref_model: str | None = None
    #: LoRA: the reference is the actor with its adapters off (no second model; needs megatron_training's
    #: lora_target_modules, and no ref_model)
    share_backbone: bool = False
    #: every this many steps (0: never), TRL's metrics over the held-out pairs (test.parquet beside train.parquet)
    test_interval: int = 0

    def check(self, name: str) -> None:
        positive(name, self, "test_interval", allow_zero=True)
        if self.use_dynamic_bsz:
            raise ConfigError(f"{name}.use_dynamic_bsz would cut micro-batches by tokens, but DPO's loss takes each "
                              f"chosen/rejected pair whole in one micro-batch; keep micro_batch_size pairs (with "
                              f"use_remove_padding: true they are packed without padding).")
        try:
            _ = self.loss  # building it checks the loss settings
        except ConfigError as err:
            raise ConfigError(f"{name}: {err}") from None

    @property
    def loss(self) -> DPOLossConfig:
        return DPOLossConfig(self.dpo_loss_type, self.dpo_beta, self.dpo_label_smoothing, self.rpo_alpha)


@dataclass(frozen=True)
class DPOConfig(StageConfig):
    section: DPOSection

    STAGE = "dpo"
    SECTION = "dpo_config"
    SECTION_TYPE = DPOSection
    CONFIGS_DIR = DPO_CONFIGS_DIR

    def check(self) -> None:
        super().check()
        if self.section.share_backbone and not self.training.lora.enabled:
            raise ConfigError("dpo_config.share_backbone: true makes the reference the actor with its LoRA adapters "
                              "off, but megatron_training sets no lora_target_modules; add adapters or turn "
                              "share_backbone off.")
        if self.section.share_backbone and self.section.ref_model is not None:
            raise ConfigError(f"dpo_config.share_backbone: true makes the reference the actor's own base, but "
                              f"ref_model ({self.section.ref_model}) names another; remove one of them.")


def load_dpo_config(config_name: str, overrides: Sequence[str] = (),
                    config_dir: str | Path | None = None) -> DPOConfig:
    """configs/dpo/<config_name>.yaml (or `config_dir`) with Hydra overrides, checked; raises ConfigError."""
    return DPOConfig.load(config_name, overrides, config_dir)
