"""Train a policy with DAPO: the GRPO driver with DAPO's loss (no KL term, no reference model), on Ray.

    python cli/train_dapo.py --config-name dapo_long_tiny_cpu [key=value ...]

MindSpeed-RL's entry point for `stage: ray_dapo` recipes; a file without a `stage` is trained as ray_dapo.
DAPO's parts are rl_config keys: clip_higher_enable with clip_ratio_low/high, token_level_loss,
filter_groups_enable (dynamic sampling) and overlong_buffer_enable. `--config-name` is a file in configs/rlxf/
(or `--config-dir`); overrides are Hydra's. The whole config is checked before any worker starts; a mistake
is one sentence and exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mindrl.console import exit_now
from mindrl.trainer.config import TRAINER_CONFIGS_DIR, check_resources, trainer_loader
from mindrl.trainer.entry import run_trainer
from mindrl.trainer.memory_plan import report


def _fit(cfg) -> None:
    from mindrl.trainer.grpo import GRPOTrainer

    GRPOTrainer(cfg).fit()


def main(argv: list[str] | None = None) -> int:
    return run_trainer(argv, __doc__.split("\n\n")[0], TRAINER_CONFIGS_DIR, trainer_loader("ray_dapo"),
                       check_resources, _fit, report)


if __name__ == "__main__":
    exit_now(main())
