"""RMSNorm with its gradient written out, for megatron-core's local layer spec.

The local spec's norm is torch.nn.RMSNorm, whose gradient autograd derives from the composite forward: a
chain of about ten elementwise products, reductions and casts over the activation. Here the forward is the
same `F.rms_norm` call (outputs unchanged, bit for bit) and the backward is the closed form in fp32 (fp64
for fp64), every operand cast explicitly (a bf16 tensor times an fp32 one runs ~25× slower on CPU than the
same product after a cast) and the result rounded once. A profiled bf16 update of the small model (64
samples, one core) spent ~0.65 s of self time in the norms' ops before and ~0.47 s after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        # y = n·w with n = x·r, r = (mean(x²) + eps)^-½:  ∂x = r·(g·w − n·mean(g·w·n)),  ∂w = Σ g·n
        x, weight = ctx.saved_tensors
        width = x.shape[-1]
        compute = torch.promote_types(x.dtype, torch.float32)
        wide = x.to(compute, copy=True)  # scaled in place below
        rstd = torch.linalg.vecdot(wide, wide).div_(width).add_(ctx.eps).rsqrt_().unsqueeze(-1)
        normed = wide.mul_(rstd)
        grad_wide = grad.to(compute)
        grad_normed = grad_wide * weight.to(compute)
        mean = torch.linalg.vecdot(grad_normed, normed).div_(width).unsqueeze(-1)
        grad_x = torch.addcmul(grad_normed, normed, mean, value=-1).mul_(rstd).to(x.dtype)
        grad_weight = (grad_wide * normed).reshape(-1, width).sum(0).to(weight.dtype)
        return grad_x, grad_weight, None


class RMSNorm(torch.nn.Module):
    """torch.nn.RMSNorm's parameter (`weight`, ones) and forward, built with megatron-core's norm signature."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_) -> None:
        super().__init__()
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError("mindrl's RMSNorm module is a plain RMSNorm: no zero-centred gamma.")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        # under sequence parallelism each TP rank normalises its own tokens: megatron-core sums the weight's
        # gradient over TP for parameters marked so
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)
