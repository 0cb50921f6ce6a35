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
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_block import TransformerBlock
from torch.utils.checkpoint import checkpoint


def recomputes_core(config) -> bool:
    """Whether the attention core is recomputed in the backward (selective recompute)."""
    return config.recompute_granularity == "selective"


class RecomputedBlock(TransformerBlock):
    """TransformerBlock whose full recompute goes through torch's non-reentrant checkpoint: `uniform` checkpoints
    the stage's layers in groups of recompute_num_layers, `block` the first recompute_num_layers layers one by one."""

    def _checkpointed_forward(self, hidden_states: torch.Tensor, attention_mask, context, context_mask,
                              rotary_pos_emb, attention_bias, packed_seq_params, use_inner_quantization_context,
                              padding_mask=None) -> torch.Tensor:
        def layers(start: int, end: int):
            def forward(hidden_states: torch.Tensor, context):
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
