"""SwiGLU as one autograd step: silu(gate) · up over fc1's [..., 2F] output, gate first.

megatron-core's unfused MLP computes `silu(gate) * (up + glu_linear_offset)`: the zero offset is added into
a copy of `up`, and autograd joins the two halves' gradients with a concatenation: two extra passes over
fc1's output (bf16, one core, the small model's micro-batch: forward 2.1–2.7 → 1.6 ms, forward and
backward 6.6–7.3 → 5.7–5.9 ms, measured in isolation). This module reaches the MLP through
megatron-core's activation-module hook (`use_te_activation_func`, which builds the MLP's
`submodules.activation_func`), computes the same products, writes both halves' gradients into one buffer and
keeps only fc1's output for the backward (megatron-core's also keeps silu(gate)). Forward and gradients equal
megatron-core's unfused ones bit for bit (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig


class _SwiGLU(torch.autograd.Function):
    """Keeps fc1's output only: silu(gate) is recomputed in the backward (one elementwise pass, the same values)
    rather than kept, a quarter of the MLP's activations."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        ctx.save_for_backward(x)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        activated = F.silu(gate)
        grad_x = torch.empty_like(x)
        grad_gate, grad_up = grad_x.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        torch.mul(grad, activated, out=grad_up)
        return grad_x


class SwiGLU(torch.nn.Module):
    """The MLP's activation module for a gated silu (`gated_linear_unit` and `activation_func` silu, no
    offset or clamp: what every supported architecture has)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if not config.gated_linear_unit or config.activation_func is not F.silu:
            raise ValueError("mindrl's SwiGLU module needs gated_linear_unit with activation_func silu.")
        if config.glu_linear_offset or config.activation_func_clamp_value is not None:
            raise ValueError("mindrl's SwiGLU module has no glu_linear_offset or activation clamp; these models "
                             "have none.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SwiGLU.apply(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Nothing to save: megatron-core's MLP asks each of its modules for its part of a distributed checkpoint."""
        return {}
