"""Running micro-batches through a (pipelined) GPTModel with Megatron's own schedules.

The same call serves PP=1 and PP>1: megatron-core picks no-pipelining or 1F1B from the
parallel state, moves activations between stages, and runs backward unless
`forward_only`. A loss function sees this rank's vocab-parallel logits and the micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from mindrl.models.moe import replay_routes

#: a vision-language micro-batch's images: every patch of its rows' images in row order, each image's grid, and
#: where their placeholders are
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_mask")

LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


def position_ids_for(tokens: torch.Tensor) -> torch.Tensor:
    """0..s-1 for every row of a [b, s] token batch."""
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def run_microbatches(model: torch.nn.Module, micro_batches: Iterable[dict], loss_fn: LossFn,
                     forward_only: bool = False) -> list[dict]:
    """Forward (and backward) every micro-batch; returns loss_fn's dicts on the last stage.

    Each micro-batch is a dict with at least `tokens` [b, s], optionally `position_ids` [b, s] ([3, b, s] for a
    vision-language model, with its rows' images as `pixel_values` and `image_grid_thw`), for
    rows packed behind shared prompts an `attention_mask` PackedLayout (mindrl/models/attention.py;
    default causal), and for a mixture of experts `routes` [b, s, MoE layers, top-k] to replay and `padding_mask`
    [b, s] (True: a padding token, which the routers' load-balancing and z-losses leave out); all must share
    b and s (the pipeline exchanges fixed-shape activations).
    Gradients accumulate in the parameters; the loss of each micro-batch is divided by their
    number, as Megatron does.
    """
    batches = list(micro_batches)
    if not batches:
        return []
    micro_batch_size, seq_length = batches[0]["tokens"].shape

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        tokens = batch["tokens"]
        replay_routes(model, batch.get("routes"))
        extra = {key: batch[key] for key in (*IMAGE_KEYS, "padding_mask") if batch.get(key) is not None}
        output = model(tokens, batch.get("position_ids", position_ids_for(tokens)), batch.get("attention_mask"),
                       **extra)

        def loss_func(logits: torch.Tensor):
            return loss_fn(logits, batch)

        return output, loss_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        # under context parallelism each micro-batch is this rank's share; the schedule divides by CP itself
        seq_length=seq_length * parallel_state.get_context_parallel_world_size(),
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def token_cross_entropy(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, dict[str, Any]]:
    """Mean next-token cross entropy of `batch["labels"]`, computed on vocab-parallel logits.

    Megatron's cross entropy works in place on fp32 logits and its schedule then divides
    the returned loss in place, so the logits and the reported value are copies.
    """
    losses = tensor_parallel.vocab_parallel_cross_entropy(logits.float().clone(), batch["labels"])
    loss = losses.mean()
    return loss, {"loss": loss.detach().clone()}


def gather_logits(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocab logits from this rank's vocab slice (for checks; training never needs it)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return logits
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)
