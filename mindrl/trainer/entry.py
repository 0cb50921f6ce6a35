"""The command line shared by the trainers (cli/train_grpo.py, cli/train_sft.py).

`--config-name` picks a file of the trainer's config folder (or `--config-dir`); the rest are
Hydra overrides. The whole config, and this machine's devices unless RAY_ADDRESS names a
running cluster (checked once the driver has joined it), are judged before any worker
starts; a mistake is one sentence on stderr and exit status 2. A rank lost mid-run, or devices the cluster
never offers, is one sentence and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mindrl.config.errors import ConfigError, RunError


def run_trainer(argv: Sequence[str] | None, description: str, config_dir: Path,
                load: Callable[[str, Sequence[str], str], Any], check_resources: Callable[[Any], None],
                fit: Callable[[Any], Any]) -> int:
    """Parse, load, check, then `fit(cfg)` (which imports the heavy parts); returns the exit status."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config-name", "-cn", required=True, help=f"config name in {config_dir.name}/")
    parser.add_argument("--config-dir", "-cd", default=str(config_dir), help="where the configs live")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, key=value")
    args = parser.parse_args(argv)
    try:
        cfg = load(args.config_name, args.overrides, args.config_dir)
        if not os.environ.get("RAY_ADDRESS"):
            check_resources(cfg)
        fit(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
