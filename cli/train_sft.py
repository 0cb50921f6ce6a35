"""Supervised fine-tuning of the Megatron actor: the SFT stage of the R1 recipe (SFT → RL).

    python cli/train_sft.py --config-name sft_tiny_cpu [key=value ...]

`--config-name` is a file in configs/sft/ (or `--config-dir`); overrides are Hydra's. The
loss is on the response tokens only; the checkpoints under `megatron_training.save` are the
ones `cli/train_grpo.py` starts from (`actor_config.load`). The config and this machine's
(or RAY_ADDRESS's cluster's) devices are checked before any worker starts; a mistake is one
sentence and exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mindrl.console import exit_now
from mindrl.trainer.entry import run_trainer
from mindrl.trainer.sft_config import SFT_CONFIGS_DIR, load_sft_config
from mindrl.trainer.stage import check_resources


def _fit(cfg) -> None:
    from mindrl.trainer.sft import SFTTrainer

    SFTTrainer(cfg).fit()


def main(argv: list[str] | None = None) -> int:
    return run_trainer(argv, __doc__.split("\n\n")[0], SFT_CONFIGS_DIR, load_sft_config, check_resources, _fit)


if __name__ == "__main__":
    exit_now(main())
