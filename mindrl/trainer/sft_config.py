"""The SFT trainer's configuration: `megatron_training` (stage sft) and `sft_config`.

`load_sft_config("sft_tiny_cpu", ["megatron_training.train_iters=50"])` composes
configs/sft/<name>.yaml with Hydra (the architecture from configs/model/ through the
defaults list, as for GRPO), refuses unknown keys and checks the layout and batch sizes;
`check_resources` is the one check that needs the machines. All before Ray starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Formatter
from typing import Any

from mindrl.config import ConfigError, resources
from mindrl.config.keys import Keys, normalise
from mindrl.config.parallel import validate_parallel
from mindrl.config.paths import CONFIGS_DIR
from mindrl.config.resources import Cluster, RoleResource
from mindrl.config.values import check_types, positive
from mindrl.trainer.config import compose
from mindrl.trainer.megatron import MegatronConfig

SFT_CONFIGS_DIR = CONFIGS_DIR / "sft"
SECTIONS = ("model", "megatron_training", "sft_config")


@dataclass(frozen=True)
class SFTSection:
    """`sft_config`: what is taught, and where the ranks run."""

    #: the response taught for each prompt: `{answer}` and the row's extra_info fields (e.g. `{solution}`)
    response_format: str = "{answer}"
    #: the trainer's devices (num_npus | num_gpus | num_cpus): one rank per device, TP×PP×DP of them
    resource: RoleResource = dataclasses.field(default_factory=lambda: RoleResource("CPU", 1))
    use_tensorboard: bool = False
    tensorboard_dir: str | None = None
    #: seconds to wait for a running cluster (RAY_ADDRESS) to offer `resource` before giving up
    resource_wait_timeout: float = 600.0
    #: a private cluster (no RAY_ADDRESS) serves Ray's dashboard (needs `pip install "ray[default]"`)
    include_dashboard: bool = False

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], keys: Keys) -> SFTSection:
        known = {f.name for f in dataclasses.fields(cls)}
        values = keys.split("sft_config", values, known)
        if "resource" in values:
            values["resource"] = RoleResource.from_dict("sft_config.resource", values["resource"])
        section = cls(**values)
        check_types("sft_config", section)
        positive("sft_config", section, "resource_wait_timeout", allow_zero=True)
        try:
            fields = [name for _, name, _, _ in Formatter().parse(section.response_format)]
        except ValueError as err:
            raise ConfigError(f"sft_config.response_format={section.response_format!r} is not a format string "
                              f"({err}); write fields as {{answer}} and literal braces as {{{{ }}}}.") from None
        if not any(fields):
            raise ConfigError(f"sft_config.response_format={section.response_format!r} names no field, so every "
                              f"prompt would be taught the same text; use {{answer}} or an extra_info field.")
        if section.use_tensorboard and not section.tensorboard_dir:
            raise ConfigError("sft_config.use_tensorboard needs tensorboard_dir, where the event files go.")
        return section


@dataclass(frozen=True)
class SFTConfig:
    training: MegatronConfig
    sft: SFTSection

    @property
    def save_dir(self) -> str | None:
        """Where the run writes its checkpoints, metrics and log."""
        return self.training.save

    @property
    def notices(self) -> tuple[str, ...]:
        """Keys that do nothing here, for the trainer to warn about once."""
        return tuple(self.training.inert_keys())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SFTConfig:
        keys = Keys()
        data = dict(normalise(data))
        for key in data:
            if key not in SECTIONS:
                keys.unknown("", key, SECTIONS)
        training = MegatronConfig.from_dict("megatron_training", data.get("megatron_training") or {},
                                            data.get("model") or {}, keys, stage="sft")
        cfg = cls(training, SFTSection.from_dict(data.get("sft_config") or {}, keys))
        cfg.check()
        return cfg

    def check(self) -> None:
        t, devices = self.training, self.sft.resource.count
        if t.data_path is None or t.tokenizer_name_or_path is None:
            raise ConfigError("megatron_training.data_path and tokenizer_name_or_path are required to train; point "
                              "them at cli/preprocess_data.py's output and the tokenizer it used.")
        try:
            validate_parallel(t.arch, t.parallel, world_size=devices)
        except ConfigError as err:
            raise ConfigError(f"megatron_training: {err}") from None
        dp = devices // (t.tensor_model_parallel_size * t.pipeline_model_parallel_size)
        if t.global_batch_size % (dp * t.micro_batch_size):
            raise ConfigError(f"global_batch_size={t.global_batch_size} does not give each of the {dp} data-parallel "
                              f"ranks whole micro-batches of micro_batch_size={t.micro_batch_size}; make it a "
                              f"multiple of {dp * t.micro_batch_size}.")
        t.check_full_checkpoints("megatron_training")


def check_resources(cfg: SFTConfig, cluster: Cluster | None = None) -> None:
    """Raise ConfigError if `cluster` (default: this machine) cannot give the trainer's devices."""
    resources.check_resources([("sft", cfg.sft.resource)], cluster)


def load_sft_config(config_name: str, overrides: Sequence[str] = (),
                    config_dir: str | Path | None = None) -> SFTConfig:
    """configs/sft/<config_name>.yaml (or `config_dir`) with Hydra overrides, checked; raises ConfigError."""
    return SFTConfig.from_dict(compose(config_name, overrides, config_dir or SFT_CONFIGS_DIR))
