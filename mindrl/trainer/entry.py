"""The command line shared by the trainers (cli/train_grpo.py, cli/train_sft.py, cli/train_dpo.py).

`--config-name` picks a file of the trainer's config folder (or `--config-dir`); the rest are
Hydra overrides. The whole config, and this machine's devices unless RAY_ADDRESS names a
running cluster (checked once the driver has joined it), are judged before any worker
starts; a mistake is one sentence on stderr and exit status 2. A rank or node lost mid-run, a phase of a step
past rl_config.phase_timeout, or devices the cluster never offers, is one sentence and exit status 1.

Once the config is good, everything the run's processes write goes to `run.log` in its `save` folder
(or runs/<config-name>/ without one) and the terminal shows mindrl's own lines (mindrl.console); an
unexpected failure shows its last lines there and leaves the whole traceback in the log.
"""

from __future__ import annotations

import argparse
import os
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mindrl.config.errors import ConfigError, RunError

#: the log file a run keeps in its save folder
RUN_LOG = "run.log"
#: traceback lines an unexpected failure shows on the terminal (the log has them all)
TAIL_LINES = 8


def run_trainer(argv: Sequence[str] | None, description: str, config_dir: Path,
                load: Callable[[str, Sequence[str], str], Any], check_resources: Callable[[Any], None],
                fit: Callable[[Any], Any], memory_plan: Callable[[Any], tuple[str, str | None]] | None = None) -> int:
    """Parse, load, check, then `fit(cfg)` (which imports the heavy parts); returns the exit status.

    `memory_plan(cfg)` gives the plan's text and its refusal (None where the config fits): the text is shown before
    anything starts, a refusal ends the run there, and `--plan` ends it after the text without asking for devices.
    """
    from mindrl.console import error, run_log, say

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config-name", "-cn", required=True, help=f"config name in {config_dir.name}/")
    parser.add_argument("--config-dir", "-cd", default=str(config_dir), help="where the configs live")
    if memory_plan is not None:
        parser.add_argument("--plan", action="store_true",
                            help="print what each device would hold (docs/memory_plan.md) and exit; needs no devices")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, key=value")
    args = parser.parse_args(argv)
    only_plan = getattr(args, "plan", False)
    plan = refusal = None
    try:
        cfg = load(args.config_name, args.overrides, args.config_dir)
        if memory_plan is not None:
            plan, refusal = memory_plan(cfg)
        if not os.environ.get("RAY_ADDRESS") and not only_plan:
            check_resources(cfg)
    except ConfigError as err:
        error(str(err))
        return 2
    if only_plan or refusal:
        for line in plan.splitlines():
            say(line)
        if refusal:
            error(refusal)
        return 2 if refusal else 0
    with run_log(Path(cfg.save_dir or Path("runs") / args.config_name) / RUN_LOG) as log:
        for line in (plan or "").splitlines():
            say(line)
        for notice in cfg.notices:
            say(f"warning: {notice}")
        try:
            fit(cfg)
        except ConfigError as err:
            error(str(err))
            return 2
        except RunError as err:
            error(f"{err} (the run's log: {log})")
            return 1
        except Exception as err:  # a failure no check foresaw: its traceback belongs in the log, its gist here
            traceback.print_exc()
            frames = "".join(traceback.format_tb(err.__traceback__)).rstrip().splitlines()[-TAIL_LINES:]
            error("\n".join([f"{type(err).__name__}: {err}", *frames, f"(the whole traceback is in {log})"]))
            return 1
    return 0
