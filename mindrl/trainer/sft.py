"""The SFT driver: the Megatron actor's ranks on Ray, taught prompt → response pairs.

The R1 recipe's first stage (SFT → DPO → RL) and the GRPO demo's warm start. Each step is one
optimizer step on `global_batch_size` examples (loss on the response tokens only,
algorithms/sft_loss.py); checkpoints are the trainer's Megatron layout, so DPO's `load` and GRPO's
`actor_config.load` start from them (at step 0, with them as the reference) and this trainer
resumes from them (weights, optimizer, RNG, data position).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mindrl.data.sft import read_sft_examples, sft_batch
from mindrl.trainer.metrics import StepTimer
from mindrl.trainer.stage import StageTrainer
from mindrl.trainer.start import JOB_SFT


class SFTTrainer(StageTrainer):
    JOB = JOB_SFT
    EXAMPLE = "example"

    def read_examples(self, path: Path) -> tuple[list, int]:
        t = self.cfg.training
        return read_sft_examples(path, self.tokenizer, self.cfg.section.response_format, t.seq_length)

    def rank_spec(self) -> tuple[type, Any]:
        from mindrl.workers.ray_ranks import SFTRank, SFTSpec

        return SFTRank, self.stage_spec(SFTSpec)

    def train_step(self) -> dict[str, float]:
        timer = StepTimer()
        with timer("all"):
            examples = self.loader.next_batch()
            batch = sft_batch(examples, self.pad_id)
            out = self.group.call("step", batch)[0]
        seconds = timer.seconds["all"]
        real = sum(len(e.prompt_ids) + len(e.response_ids) for e in examples)
        return {"sft/loss": out["sft_loss"], "grad_norm": out["grad_norm"], "actor/lr": out["lr"],
                "sft/response_tokens": batch["loss_mask"].sum().item(), "timing/all": seconds,
                "tokens_per_s": real / seconds}
