"""Where a run starts: fresh weights, converted weights, or a training checkpoint to resume.

`actor_config.load` (MindSpeed-RL / Megatron-LM's `load`) names a Megatron checkpoint root:
- a `release` checkpoint (cli/convert_ckpt.py's output), a checkpoint of another job (GRPO
  loading the SFT stage's output: the R1 recipe's SFT → RL) or any checkpoint with
  `finetune: true`: the run starts from its weights at step 0;
- a training checkpoint written by the same job: the run resumes at its iteration — weights,
  optimizer and scheduler (unless no_load_optim), random generators (unless no_load_rng), the
  data position and the step — and the reference is built from the weights the run first
  started from, which the checkpoint records, not from `load`;
- nothing: random initialisation from `seed` (the CPU demo's tiny model).
It is decided here, in the driver, before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindrl.checkpoint import files
from mindrl.checkpoint import megatron as mg
from mindrl.config import ConfigError
from mindrl.config.lora import LoraConfig
from mindrl.trainer.megatron import MegatronConfig

#: what a training checkpoint's `job` says wrote it (checkpoints without one are GRPO's)
JOB_GRPO, JOB_SFT, JOB_DPO, JOB_PPO = "grpo", "sft", "dpo", "ppo"


@dataclass(frozen=True)
class StartPoint:
    #: the step the run has completed (0: a fresh start)
    iteration: int
    #: Megatron checkpoint root of the weights the run started from (None: random initialisation)
    initial_weights: str | None
    #: training checkpoint root the actor resumes from
    resume: str | None = None
    #: the trainer's state saved with that checkpoint (data position)
    extra: dict[str, Any] | None = None
    #: whether that checkpoint was trained in bf16 (`bf16: auto` keeps its precision on resume)
    bf16: bool | None = None


def start_point(actor: MegatronConfig, job: str = JOB_GRPO, section: str = "actor_config") -> StartPoint:
    """`job` is the trainer asking (JOB_GRPO, JOB_SFT, JOB_DPO or JOB_PPO): only its own checkpoints resume. A resume
    point past train_iters is refused (`section` names where `load` was set)."""
    start = _start_point(actor, job, section)
    if start.iteration > actor.train_iters:
        raise ConfigError(f"{section}.load is at iteration {start.iteration}, past train_iters={actor.train_iters}; "
                          f"raise train_iters to train further.")
    return start


def _start_point(actor: MegatronConfig, job: str, section: str) -> StartPoint:
    if actor.load is None:
        return StartPoint(0, None)
    root = Path(actor.load)
    if not (root / mg.TRACKER).is_file():
        raise ConfigError(f"{section}.load={actor.load} holds no {mg.TRACKER}; point it at a checkpoint from "
                          f"cli/convert_ckpt.py (hf → mg) or from a previous run's `save`.")
    iteration = _iteration(root, actor, section)
    files.check_format(root, iteration, actor.ckpt_format, actor.auto_detect_ckpt_format, f"{section}.load")
    if iteration != "release":
        _refuse_damaged(root, iteration, section)
    files.check_checkpoint(root, iteration, actor.arch, actor.parallel)  # here, not in the workers after Ray starts
    if iteration == "release" or actor.finetune or not files.holds_training_state(root, iteration):
        if (files.first_state(root, iteration).get("lora") or {}).get("adapters_only"):
            raise ConfigError(f"{section}.load=" + LoraConfig.no_base(root))
        files.check_start(root, iteration, f"{section}.load")
        if actor.ckpt_step is not None:
            raise ConfigError(f"{section}.ckpt_step={actor.ckpt_step} picks the training checkpoint a run resumes "
                              f"from, but {root} is loaded as starting weights (converted, or finetune: true), "
                              f"which come from the iteration its tracker names; remove ckpt_step.")
        return StartPoint(0, str(root))  # weights to start from: converted, re-sharded, or asked to start over
    state = files.first_state(root, iteration)
    extra = dict(state.get("extra") or {})
    if extra.get("job", JOB_GRPO) != job:
        files.check_start(root, iteration, f"{section}.load")
        return StartPoint(0, str(root))
    if "data" not in extra:
        raise ConfigError(f"{root} iteration {iteration} is not a training checkpoint of this trainer (it records no "
                          f"data position); set finetune: true to start from its weights at step 0.")
    mismatch = actor.lora.resume_mismatch(state.get("lora"))
    if mismatch:  # here, not in the workers after Ray starts
        raise ConfigError(f"{section}.load: checkpoint {root} iteration {iteration} {mismatch}")
    return StartPoint(iteration, extra.get("initial_weights"), str(root), extra,
                      bool(getattr(state.get("args"), "bf16", False)))


def _iteration(root: Path, actor: MegatronConfig, section: str) -> int | str:
    """The tracker's iteration, or the one ckpt_step picks (which must be there)."""
    if actor.ckpt_step is None:
        return mg.read_tracker(root)
    held = mg.iterations(root)
    if actor.ckpt_step not in held:
        raise ConfigError(f"{section}.ckpt_step={actor.ckpt_step}, but {root} holds iterations "
                          f"{', '.join(map(str, held)) or 'none'}; pick one of them.")
    return actor.ckpt_step


def _refuse_damaged(root: Path, iteration: int, section: str) -> None:
    """A checkpoint cut short is one sentence before any worker starts, naming what loads instead."""
    problem = files.damage(root, iteration)
    if problem is None:
        return
    earlier = files.newest_complete(root, iteration)
    instead = (f"iteration {earlier}, the newest complete one before it, resumes with {section}.ckpt_step={earlier}"
               if earlier is not None else f"no complete iteration before it is there: start over without "
                                           f"{section}.load")
    raise ConfigError(f"{problem}, so iteration {iteration} of {root} cannot be loaded; {instead}.")


def saved_extra(root: Path, iteration: int) -> dict[str, Any]:
    """The trainer state every rank file of a checkpoint carries (the same on each); read from the first."""
    return dict(files.first_state(root, iteration).get("extra") or {})
