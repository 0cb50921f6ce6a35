"""The reward-model worker: a Megatron model with a scalar head (RewardGPTModel), forward only.

Each row is scored at one position, `score_positions[row]`: the trainer passes the last token of
the response — its EOS when the engine generated one, else the last token before max_tokens cut
it — so the score has read the whole prompt and response, as HF's *ForSequenceClassification
pools at the last non-padding token. Rows are split over data-parallel ranks like the other
roles' and run in micro-batches through Megatron's schedule (TP and PP as the actor's workers).
"""

from __future__ import annotations

import torch

from mindrl.config import ConfigError, ModelArch, ParallelConfig
from mindrl.config.batching import Batching
from mindrl.models import context_parallel
from mindrl.workers.megatron_worker import MegatronWorker, check_batch


class RewardModelWorker(MegatronWorker):
    """Weights come from a reward-model checkpoint and never change: no optimizer, no gradients."""

    def __init__(self, arch: ModelArch, par: ParallelConfig, weights: str | dict, params_dtype: torch.dtype,
                 micro_batch_size: int, seed: int = 1234, batching: Batching | None = None) -> None:
        if arch.num_labels != 1:
            has = "no score head" if arch.num_labels is None else f"a score head of {arch.num_labels} outputs"
            raise ConfigError(f"model {arch.name} has {has}; the reward worker takes a reward model with one output "
                              f"(HF *ForSequenceClassification, num_labels 1, converted with --orm).")
        super().__init__(arch, par, weights, params_dtype, micro_batch_size=micro_batch_size, seed=seed,
                         batching=batching)
        self.model.requires_grad_(False)

    def score(self, batch: dict) -> torch.Tensor | None:
        """The score of each of this rank's rows at its `score_positions` (fp32, [rows]); None off the last stage."""
        check_batch(batch, ())
        positions = batch.get("score_positions")
        if not torch.is_tensor(positions) or positions.shape != batch["tokens"].shape[:1]:
            raise ValueError("batch lacks 'score_positions', one position per row of the tokens.")
        if positions.min() < 0 or positions.max() >= batch["tokens"].shape[1]:
            raise ValueError(f"score_positions must lie in [0, {batch['tokens'].shape[1]}); got "
                             f"{positions.min().item()}..{positions.max().item()}.")

        def pick(scores: torch.Tensor, mb: dict) -> dict[str, torch.Tensor]:
            rows = torch.arange(mb["score_positions"].shape[0], device=scores.device)
            if "source" not in mb:
                return {"scores": scores[rows, mb["score_positions"], 0].float()}
            # a packed sequence: where each row's scored token is in it (under CP: in this rank's share, or −1)
            where = mb["source"][rows, mb["score_positions"]]
            picked = torch.where(where >= 0, scores[0, where.clamp(min=0), 0].float(), 0.0)
            return {"scores": context_parallel.merge(picked)}

        out = self._forward_rows({"tokens": batch["tokens"], "score_positions": positions}, pick)
        return None if out is None else out["scores"]
