"""MindSpeed-RL's `stage: ray_dapo`: the GRPO driver with DAPO's loss, which has no KL term.

MindSpeed-RL's DAPO actor loss returns a zero KL loss whatever `init_kl_coef` says, and its DAPO
trainer computes no reference log-probs; the recipes rely on it (most leave `init_kl_coef` at its
0.01 default). mindrl gives the stage the same meaning — no KL loss, no reference model — and says
so where a recipe asks for a KL weight, rather than silently training a different objective. DAPO's
other parts (clip-higher, token-level loss, dynamic sampling, the overlong penalty) are the recipe's
own rl_config keys and mean the same under either stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from mindrl.trainer.rl import RLConfig

DAPO = "ray_dapo"


def dapo_rl_config(rl: RLConfig, given: Mapping[str, Any]) -> tuple[RLConfig, list[str]]:
    """`rl` with the KL loss off, and a notice where the file (`given`, its rl_config) asked for one."""
    notices = []
    if float(given.get("init_kl_coef") or 0.0) > 0:
        notices.append(f"rl_config.init_kl_coef={given['init_kl_coef']} has no effect under stage ray_dapo (DAPO's "
                       f"loss has no KL term and no reference model runs, as in MindSpeed-RL); use stage ray_grpo "
                       f"with the same DAPO keys for a KL-regularised run.")
    return replace(rl, init_kl_coef=0.0), notices
