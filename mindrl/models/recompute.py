"""Activation recompute (Megatron's `recompute_granularity` full | selective) with torch's non-reentrant checkpoint.

megatron-core recomputes through its reentrant CheckpointFunction, which saves every argument with
save_for_backward and so takes tensors only; mindrl's attention masks are layouts of packed rows and samples
(mindrl/models/attention.py), not tensors. torch's non-reentrant checkpoint takes any argument and recomputes the
same operations in the same order, so the gradients are the ones without recompute, bit for bit (tested). The RNG
replay megatron-core's version adds is for dropout, which mindrl's models do not have.

`full` recomputes whole transformer layers: megatron-core's TransformerBlock calls `_checkpointed_forward` when the
config asks for full recompute in training, and `RecomputedBlock` is that block with mindrl's version of it.
`selective` recomputes the attention core only (its score matrices are the activations that grow with the square of
the sequence): SDPAttention wraps itself (`recomputes_core`).

A recomputed layer runs its routers again: what they log (megatron-core's router-loss tracker, mindrl's expert load)
must count each micro-batch once, so a recomputed forward logs nothing (`recomputing`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.transformer_block import TransformerBlock
from torch.utils.checkpoint import checkpoint

_RECOMPUTING: ContextVar[bool] = ContextVar("mindrl_recomputing", default=False)


def recomputes_core(config) -> bool:
    """Whether the attention core is recomputed in the backward (selective recompute)."""
    return config.recompute_granularity == "selective"


def recomputing() -> bool:
    """Whether the forward running now is a backward's recompute of one already counted."""
    return _RECOMPUTING.get()


@contextmanager
def _recompute() -> Iterator[None]:
    """A recomputed forward: `recomputing()` is true and megatron-core's router-loss tracker ends as it began."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    kept = {name: entry["values"].clone() for name, entry in tracker.items()}
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:  # torch may stop a recompute early, by an exception, once it has what the backward needs
        _RECOMPUTING.reset(token)
        for name, values in kept.items():
            tracker[name]["values"].copy_(values)


class RecomputedBlock(TransformerBlock):
    """TransformerBlock whose full recompute goes through torch's non-reentrant checkpoint: `uniform` checkpoints
    the stage's layers in groups of recompute_num_layers, `block` the first recompute_num_layers layers one by one."""

    def _checkpointed_forward(self, hidden_states: torch.Tensor, attention_mask, context, context_mask,
                              rotary_pos_emb, attention_bias, packed_seq_params, use_inner_quantization_context,
                              padding_mask=None) -> torch.Tensor:
        def layers(start: int, end: int):
            runs = [0]  # the checkpoint calls it in the forward, then again to recompute in the backward

            def forward(hidden_states: torch.Tensor, context):
                runs[0] += 1
                with _recompute() if runs[0] > 1 else nullcontext():
                    for index in range(start, end):
                        hidden_states, context = self.layers[index](
                            hidden_states=hidden_states, attention_mask=attention_mask, context=context,
                            context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias,
                            inference_context=None, packed_seq_params=packed_seq_params, padding_mask=padding_mask)
                return hidden_states, context
            return forward

        count, n = len(self.layers), self.config.recompute_num_layers
        if self.config.recompute_method == "uniform":
            groups = [(start, min(start + n, count), True) for start in range(0, count, n)]
        else:
            groups = [(index, index + 1, index < n) for index in range(count)]
        for start, end, recomputed in groups:
            run = layers(start, end)
            if recomputed:
                hidden_states, context = checkpoint(run, hidden_states, context, use_reentrant=False)
            else:
                hidden_states, context = run(hidden_states, context)
        return hidden_states
