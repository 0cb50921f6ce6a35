"""Train a policy with PPO: GRPO's Megatron actor, reference and rollouts, plus a Megatron critic (GAE), on Ray.

    python cli/train_ppo.py --config-name ppo_tiny_cpu [key=value ...]

`--config-name` is a file in configs/rlxf/ (or `--config-dir`) with `rl_config.adv_estimator: gae` and a
`critic_config` section; overrides are Hydra's. The whole config is checked before any worker starts; a
mistake is one sentence and exit status 2.
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
    from mindrl.trainer.ppo import PPOTrainer

    PPOTrainer(cfg).fit()


def main(argv: list[str] | None = None) -> int:
    return run_trainer(argv, __doc__.split("\n\n")[0], TRAINER_CONFIGS_DIR, trainer_loader("ray_ppo"),
                       check_resources, _fit, report)


if __name__ == "__main__":
    exit_now(main())
