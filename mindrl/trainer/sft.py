"""The SFT driver: the Megatron actor's ranks on Ray, taught prompt → response pairs.

The R1 recipe's first stage (SFT → RL) and the GRPO demo's warm start. Each step is one
optimizer step on `global_batch_size` examples (loss on the response tokens only,
algorithms/sft_loss.py); checkpoints are the trainer's Megatron layout, so GRPO's
`actor_config.load` starts from them (at step 0, with them as its KL reference) and
this trainer resumes from them (weights, optimizer, RNG, data position).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mindrl.console import say
from mindrl.data.sft import read_sft_examples, sft_batch
from mindrl.trainer.export import export_hf
from mindrl.trainer.metrics import METRICS_FILE, MetricsSink, StepTimer
from mindrl.trainer.prompts import PromptLoader, split_path
from mindrl.trainer.sft_config import SFTConfig, check_resources
from mindrl.trainer.start import JOB_SFT, StartPoint, start_point


class SFTTrainer:
    def __init__(self, cfg: SFTConfig) -> None:
        from mindrl.data.tokenizer import load_tokenizer

        self.cfg, t = cfg, cfg.training
        self.start: StartPoint = start_point(t, JOB_SFT, section="megatron_training")
        self.tokenizer = load_tokenizer(t.tokenizer_name_or_path, t.arch)
        path = split_path(t.data_path, "train")
        examples, too_long = read_sft_examples(path, self.tokenizer, cfg.sft.response_format, t.seq_length)
        say(f"{len(examples)} SFT examples from {path}"
            f"{f', {too_long} longer than seq_length={t.seq_length} left out' if too_long else ''}")
        self.loader = PromptLoader(examples, t.global_batch_size, t.seed, shuffle=not t.no_shuffle)
        pad = self.tokenizer.pad_token_id
        self.pad_id = self.tokenizer.eos_token_id if pad is None else pad
        self.group = self.sink = None

    def _spec(self) -> Any:
        from mindrl.workers.ray_ranks import SFTSpec

        t = self.cfg.training
        return SFTSpec(t.arch, t.parallel, t.actor_config(t.global_batch_size), t.bf16, self.start.initial_weights,
                       self.start.resume, self.start.iteration if self.start.resume else None, self.start.bf16,
                       not t.no_load_optim, not t.no_load_rng)

    def setup(self) -> None:
        from mindrl.trainer.cluster import connect_when_ready
        from mindrl.workers.group import COLLECTIVE_TIMEOUT_S, WorkerGroup
        from mindrl.workers.ray_ranks import SFTRank

        t, resource = self.cfg.training, self.cfg.sft.resource
        connect_when_ready(lambda cluster: check_resources(self.cfg, cluster), self.cfg.sft.resource_wait_timeout,
                           self.cfg.sft.include_dashboard)
        weights = self.start.initial_weights or f"random (seed {t.seed})"
        say(f"starting {resource.count} SFT ranks ({resource}), "
            f"{'resuming ' + self.start.resume if self.start.resume else 'weights ' + weights}")
        self.group = WorkerGroup("sft", SFTRank, resource)
        host, port = self.group.rendezvous(COLLECTIVE_TIMEOUT_S)
        ranks = self.group.call("setup", host, port, self._spec(), COLLECTIVE_TIMEOUT_S)
        say(ranks[0]["precision"].line)
        if self.start.resume:
            self.loader.load_state_dict(ranks[0]["extra"]["data"])
            say(f"resumed from {self.start.resume} at iteration {self.start.iteration} "
                f"(epoch {self.loader.epoch}, example {self.loader.position})")
            if ranks[0]["schedule_note"]:
                say(f"warning: {ranks[0]['schedule_note']}")
        self.sink = MetricsSink(t.train_iters, Path(t.save) / METRICS_FILE if t.save else None,
                                self.cfg.sft.tensorboard_dir if self.cfg.sft.use_tensorboard else None,
                                self.start.iteration)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
        if self.group is not None:
            self.group.kill()

    def fit(self) -> Path | None:
        """Train to train_iters; returns the final weights exported to HF (None without `save`)."""
        t = self.cfg.training
        try:
            self.setup()
            for step in range(self.start.iteration + 1, t.train_iters + 1):
                self.sink.log(step, self.train_step())
                if t.saves_at(step):
                    extra = {"job": JOB_SFT, "data": self.loader.state_dict(),
                             "initial_weights": self.start.initial_weights, "step": step}
                    self.group.call("save", t.save, step, extra)
            return export_hf(t.save, t.tokenizer_name_or_path) if t.save else None
        finally:
            self.close()

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
