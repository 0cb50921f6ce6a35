"""The DPO driver: the Megatron actor and its frozen reference on Ray, taught preference pairs.

The R1 recipe's optional stage between SFT and GRPO (SFT → DPO → GRPO), on the same actor, layouts and
checkpoints: it starts from SFT's checkpoint (`megatron_training.load`), its reference is the weights it
starts from unless `ref_model` names another checkpoint, and GRPO's `actor_config.load` starts from its
checkpoint (at step 0, with it as GRPO's reference). Each step is one optimizer step on `global_batch_size`
pairs; the reference's log-probs are computed once per batch, in the same ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mindrl.algorithms.dpo_loss import pair_losses, sequence_chosen_nll
from mindrl.checkpoint import files
from mindrl.checkpoint import megatron as mg
from mindrl.config import ConfigError
from mindrl.data.preference import dpo_batch, read_pairs
from mindrl.trainer.dpo_config import DPOConfig
from mindrl.trainer.metrics import StepTimer
from mindrl.trainer.prompts import split_path
from mindrl.trainer.stage import StageTrainer
from mindrl.trainer.start import JOB_DPO

#: the worker's DPO metrics, under the names TRL logs them
TRL_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected")


class DPOTrainer(StageTrainer):
    JOB = JOB_DPO
    EXAMPLE = "pair"

    def __init__(self, cfg: DPOConfig) -> None:
        reference = cfg.section.ref_model
        if reference is not None:  # here, not in the workers after Ray starts
            root = Path(reference)
            if not (root / mg.TRACKER).is_file():
                raise ConfigError(f"dpo_config.ref_model={reference} holds no {mg.TRACKER}; point it at a Megatron "
                                  f"checkpoint (cli/convert_ckpt.py's output or a run's `save`).")
            files.check_checkpoint(root, mg.read_tracker(root), cfg.training.arch, cfg.training.parallel)
        super().__init__(cfg)
        t, test_path = cfg.training, split_path(cfg.training.data_path, "test")
        self.test_pairs = []
        if cfg.section.test_interval and test_path.is_file():
            self.test_pairs, _ = read_pairs(test_path, t.seq_length)
            if len(self.test_pairs) < t.global_batch_size:
                raise ConfigError(f"{test_path} holds {len(self.test_pairs)} pairs that fit seq_length, fewer than "
                                  f"one batch of global_batch_size={t.global_batch_size}; add held-out pairs or set "
                                  f"dpo_config.test_interval: 0.")

    def read_examples(self, path: Path) -> tuple[list, int]:
        return read_pairs(path, self.cfg.training.seq_length)

    def rank_spec(self) -> tuple[type, Any]:
        from mindrl.workers.ray_ranks import DPORank, DPOSpec

        section = self.cfg.section
        return DPORank, self.stage_spec(DPOSpec, rows_per_example=2, loss=section.loss, reference=section.ref_model,
                                           share_backbone=section.share_backbone)

    def train_step(self) -> dict[str, float]:
        timer = StepTimer()
        with timer("all"):
            pairs = self.loader.next_batch()
            batch = dpo_batch(pairs, self.pad_id)
            out = self.group.call("step", batch)[0]
        seconds = timer.seconds["all"]
        real = sum(2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
        nll = {"dpo/nll_loss": out["nll_loss"]} if "nll_loss" in out else {}
        return {"dpo/loss": out["dpo_loss"], **nll, **{name: out[name] for name in TRL_NAMES},
                "grad_norm": out["grad_norm"], "actor/lr": out["lr"], "actor/prompt_packed": out["prompt_packed"],
                "timing/all": seconds, "tokens_per_s": real / seconds}

    def validate(self, step: int) -> dict[str, float]:
        """TRL's metrics over the held-out pairs every test_interval steps, in whole batches of global_batch_size
        pairs (a remainder smaller than a batch is left out); with rpo_alpha also the chosen answers' NLL per
        token, the quantity RPO's term holds down."""
        from mindrl.workers.group import gather_rows

        if not self.test_pairs or step % self.cfg.section.test_interval:
            return {}
        loss, size, sums, count = self.cfg.section.loss, self.cfg.training.global_batch_size, {}, 0
        nll, chosen_tokens = 0.0, 0
        for start in range(0, len(self.test_pairs) - size + 1, size):
            pairs = self.test_pairs[start:start + size]
            both = gather_rows(self.group.call("sequence_log_probs", dpo_batch(pairs, self.pad_id)), self.dp_size)
            _, per_pair = pair_losses(loss, both[:, 0], both[:, 1])
            for key, values in per_pair.items():
                sums[key] = sums.get(key, 0.0) + values.sum().item()
            count += size
            if loss.rpo_alpha:
                lengths = torch.tensor([len(p.chosen_ids) for p in pairs], dtype=both.dtype)
                nll += sequence_chosen_nll(loss, both[:, 0], lengths).item()
                chosen_tokens += int(lengths.sum())
        metrics = {f"validation/{'dpo/loss' if key == 'dpo_loss' else key}": value / count
                   for key, value in sums.items()}
        if loss.rpo_alpha:
            metrics["validation/dpo/nll_loss"] = nll / chosen_tokens
        return metrics
