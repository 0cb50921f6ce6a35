"""Megatron's DDP wrapper and (distributed) optimizer around a GPTModel stage.

The distributed optimizer shards fp32 master weights and Adam state across the
data-parallel group (ZeRO-1): it is what lets a 7B actor fit next to its rollout engine.
"""

from __future__ import annotations

import warnings

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer


def wrap_for_training(model: torch.nn.Module, lr: float, min_lr: float = 0.0, weight_decay: float = 0.0,
                      clip_grad: float = 1.0, adam_beta1: float = 0.9, adam_beta2: float = 0.999,
                      use_distributed_optimizer: bool = True,
                      ) -> tuple[DistributedDataParallel, MegatronOptimizer]:
    """DDP-wrapped model and its optimizer; gradients reduce in fp32 whatever the params dtype.

    The model's config learns to finalise gradients (DP reduce-scatter / all-reduce, and
    the tied-embedding sum across pipeline stages) at the end of each schedule run.

    A constant loss scale of 1 changes no number but gives fp32 and bf16 a grad scaler as fp16 has one:
    megatron-core's optimizer then skips a step whose gradients hold a NaN or inf on any rank (found over the
    whole data- and model-parallel group, so every rank skips alike) and returns (False, None, None). Without
    it, clipping by a NaN norm leaves the NaN in place and Adam writes NaN weights. (The distributed optimizer,
    and bf16 without it, take the scaler; fp32 without it is megatron-core's FP32Optimizer, which has none.)
    """
    config = model.config
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                      use_distributed_optimizer=use_distributed_optimizer),
        model,
    )
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=min_lr,  # the scheduler reads each param group's own; None breaks any decay
            weight_decay=weight_decay,
            clip_grad=clip_grad,
            adam_beta1=adam_beta1,
            adam_beta2=adam_beta2,
            bf16=config.bf16,
            fp16=config.fp16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=use_distributed_optimizer,
            # a constant scaler for fp32 and bf16: non-finite gradients skip the step (docstring); fp16 keeps
            # Megatron's dynamic one
            loss_scale=None if config.fp16 else 1.0,
        ),
        [ddp],
    )
    return ddp, optimizer


def zero_grads(ddp: DistributedDataParallel, optimizer: MegatronOptimizer) -> None:
    """Clear the grad buffers and the optimizer's main-param grads before a new step.

    The distributed optimizer's shard masters are views, and it reads their .grad to clear
    it; torch warns about .grad on a non-leaf. Silenced for this call only.
    """
    ddp.zero_grad_buffer()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf",
                                category=UserWarning)
        optimizer.zero_grad()
