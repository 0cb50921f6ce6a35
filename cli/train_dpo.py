"""DPO of the Megatron actor on preference pairs: the optional stage of the R1 recipe (SFT → DPO → GRPO).

    python cli/train_dpo.py --config-name dpo_facts_cpu [key=value ...]

`--config-name` is a file in configs/dpo/ (or `--config-dir`); overrides are Hydra's. The data is
cli/preprocess_data.py's output with `is_pairwise_dataset: true`; the checkpoints under
`megatron_training.save` are the ones `cli/train_grpo.py` starts from (`actor_config.load`). The config
and this machine's (or RAY_ADDRESS's cluster's) devices are checked before any worker starts; a mistake is
one sentence and exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mindrl.console import exit_now
from mindrl.trainer.dpo_config import DPO_CONFIGS_DIR, load_dpo_config
from mindrl.trainer.entry import run_trainer
from mindrl.trainer.stage import check_resources


def _fit(cfg) -> None:
    from mindrl.trainer.dpo import DPOTrainer

    DPOTrainer(cfg).fit()


def main(argv: list[str] | None = None) -> int:
    return run_trainer(argv, __doc__.split("\n\n")[0], DPO_CONFIGS_DIR, load_dpo_config, check_resources, _fit)


if __name__ == "__main__":
    exit_now(main())
