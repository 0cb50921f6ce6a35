"""Train a policy with GRPO: Megatron actor and reference, vLLM rollouts, rule rewards, on Ray.

    python cli/train_grpo.py --config-name grpo_tiny_cpu [key=value ...]

`--config-name` is a file in configs/rlxf/ (or `--config-dir`); overrides are Hydra's
(`rl_config.n_samples_per_prompt=8`, `+rl_config.new_key=1`, `~section.key`). The whole
config is checked — keys, layouts, batch sizes, this machine's (or RAY_ADDRESS's cluster's)
devices — before any worker starts; a mistake is one sentence and exit status 2.
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
    return run_trainer(argv, __doc__.split("\n\n")[0], TRAINER_CONFIGS_DIR, trainer_loader("ray_grpo"), check_resources,
                       _fit, report)


if __name__ == "__main__":
    exit_now(main())
