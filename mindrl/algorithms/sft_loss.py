"""The supervised fine-tuning loss: negative log-likelihood of the response tokens.

Every response token of the batch weighs the same (token-mean over the whole batch), so a
batch split into micro-batches and data-parallel ranks minimises the same loss as one
pass over it; prompt and padding positions carry no loss. This is the SFT stage of the
R1 recipe (SFT → RL) and the GRPO demo's warm start.
"""

from __future__ import annotations

import torch

from mindrl.algorithms.aggregation import aggregate


def sft_loss(log_prob: torch.Tensor, mask: torch.Tensor,
             num_tokens: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of this share of the batch and its metric share (summing shares gives the batch's value).

    `num_tokens` is the whole batch's count of response tokens; without it the share is the
    micro-batch's own mean.
    """
    loss = aggregate(-log_prob, mask.float(), "token-mean", num_tokens=num_tokens)
    return loss, {"sft_loss": loss.item()}
