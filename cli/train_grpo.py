"""Train a policy with GRPO: Megatron actor and reference, vLLM rollouts, rule rewards, on Ray.

    python cli/train_grpo.py --config-name grpo_tiny_cpu [key=value ...]

`--config-name` is a file in configs/rlxf/ (or `--config-dir`); overrides are Hydra's
(`rl_config.n_samples_per_prompt=8`, `+rl_config.new_key=1`, `~section.key`). The whole
config is checked — keys, layouts, batch sizes, this machine's (or RAY_ADDRESS's cluster's)
devices — before any worker starts; a mistake is one sentence and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mindrl.config.errors import ConfigError
from mindrl.trainer.config import TRAINER_CONFIGS_DIR, check_resources, load_trainer_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", "-cn", required=True, help="trainer config name in configs/rlxf/")
    parser.add_argument("--config-dir", "-cd", default=str(TRAINER_CONFIGS_DIR), help="where trainer configs live")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, key=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_trainer_config(args.config_name, args.overrides, args.config_dir)
        if not os.environ.get("RAY_ADDRESS"):  # a running cluster is checked once the driver has joined it
            check_resources(cfg)
        from mindrl.trainer.grpo import GRPOTrainer

        GRPOTrainer(cfg).fit()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
