"""Rollouts as the rows the Megatron workers score and train on.

The workers' log-probs are shifted: position t holds log p(token t+1 | tokens ≤ t). So the
loss mask marks the positions *before* each response token, and the engine's log-prob of a
response token goes to the same position; then engine, old, reference and new log-probs of
one token sit in one column and can be compared or combined without re-indexing. In a multi-turn
response the tool turns' tokens are context, not actions: they stay off the loss mask (and their
engine log-prob is 0), so every loss, KL, entropy, advantage and metric that reads the mask skips them.
"""

from __future__ import annotations

import torch

from mindrl.data.images import PromptImages
from mindrl.models.vision import rows_of_images
from mindrl.rollout.base import RolloutResult, ToolStats


def rollout_batch(prompts: list[list[int]], result: RolloutResult, n: int, pad_id: int = 0,
                  images: list[PromptImages | None] | None = None) -> dict[str, torch.Tensor]:
    """Row i·n + j is prompt i then its j-th response, right-padded with `pad_id` to the longest row:
    `tokens` [rows, width], `loss_mask` and `engine_log_probs` [rows, width] (float, zero off the mask),
    `prompt_lengths` and `response_lengths` [rows]; with `images` (a vision-language model's prompts), each row's
    images as `pixel_values` and `image_grid_thw` (mindrl.models.vision.rows_of_images). The image tokens are
    in the prompt, so off the loss mask; so are a multi-turn response's tool tokens (`result.response_masks`)."""
    rows = len(result.responses)
    if rows != len(prompts) * n:
        raise ValueError(f"{rows} responses do not make {n} samples for each of {len(prompts)} prompts; "
                         f"pass the n the rollout was generated with.")
    sequences = [prompts[row // n] + response for row, response in enumerate(result.responses)]
    width = max(len(sequence) for sequence in sequences)
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    loss_mask, engine = torch.zeros(rows, width), torch.zeros(rows, width)
    masks = result.response_masks or [[1] * len(response) for response in result.responses]
    for row, (sequence, log_probs, mask) in enumerate(zip(sequences, result.log_probs, masks, strict=True)):
        start = len(prompts[row // n]) - 1
        tokens[row, :len(sequence)] = torch.tensor(sequence)
        loss_mask[row, start:len(sequence) - 1] = torch.tensor(mask, dtype=torch.float32)
        engine[row, start:len(sequence) - 1] = torch.tensor(log_probs, dtype=torch.float32)
    batch = {"tokens": tokens, "loss_mask": loss_mask, "engine_log_probs": engine,
             "prompt_lengths": torch.tensor([len(prompts[row // n]) for row in range(rows)]),
             "response_lengths": torch.tensor([len(response) for response in result.responses])}
    if result.routes is not None:
        batch["routes"] = routes_batch(result.routes, width)
    if result.tool_stats is not None:  # for the metrics (mindrl.trainer.metrics.multi_turn_metrics), not the workers
        batch.update(tool_stats_batch(result.tool_stats))
    if images is not None:
        per_prompt = [i.pixels() if i is not None else None for i in images]
        batch["pixel_values"], batch["image_grid_thw"] = rows_of_images([per_prompt[r // n] for r in range(rows)])
    return batch


def tool_stats_batch(stats: list[ToolStats]) -> dict[str, torch.Tensor]:
    """Per row: model turns, tool calls run, those that answered (ok), and those that failed (error) or were stopped
    (timeout, killed)."""
    return {"turns": torch.tensor([s.turns for s in stats]), "tool_calls": torch.tensor([s.calls for s in stats]),
            "tool_calls_ok": torch.tensor([s.ok_calls for s in stats]),
            "tool_errors": torch.tensor([s.statuses.count("error") for s in stats]),
            "tool_stopped": torch.tensor([sum(x in ("timeout", "killed") for x in s.statuses) for s in stats])}


def routes_batch(routes: list[torch.Tensor], width: int) -> torch.Tensor:
    """The engine's routes as [rows, width, MoE layers, top-k]; positions it never fed (the last token, padding)
    route to experts 0 … k − 1: their outputs reach no scored position (the model is causal)."""
    layers, k = routes[0].shape[1:]
    out = torch.arange(k, dtype=torch.int16).expand(len(routes), width, layers, k).clone()
    for row, route in enumerate(routes):
        out[row, :route.shape[0]] = route
    return out
