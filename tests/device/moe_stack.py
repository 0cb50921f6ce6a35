"""A stack of real MoE layers (Qwen3-30B-A3B's: 128 experts of 768, top-8, by default four of its 48 layers) forward
and backward on one row of tokens, bf16: FLOP/s of the active weights, attention and the LM head, against the
matmul rate measured beside it (docs/benchmarks.md's probe, as a script)."""

from __future__ import annotations

import dataclasses

import torch

from tests.device.sizes import Sizes


def figures(rank: int, sizes: Sizes, dtype: torch.dtype) -> dict:
    from mindrl.config import ParallelConfig, load_model_arch
    from mindrl.distributed import init_model_parallel
    from mindrl.models.flops import forward_flops
    from mindrl.models.forward import run_microbatches, token_cross_entropy
    from mindrl.models.gpt import build_gpt_model
    from mindrl.platform import get_platform
    from tests.device.timing import best_seconds, matmul_flops

    arch = dataclasses.replace(load_model_arch(sizes.moe_model), num_layers=sizes.moe_layers)
    par = ParallelConfig(1, 1)
    init_model_parallel(par, arch=arch)
    model = build_gpt_model(arch, par, dtype)
    device = get_platform().device()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.padded_vocab_size, (1, sizes.moe_tokens), generator=gen).to(device)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1)}
    seconds, _ = best_seconds(lambda: run_microbatches(model, [batch], token_cross_entropy), sizes.repeats)
    count = sizes.moe_tokens
    flops = 3.0 * forward_flops(arch, count, count * (count + 1) / 2)
    peak = matmul_flops(sizes.matmul, dtype, sizes.repeats)
    return {"model": f"{sizes.moe_model} × {sizes.moe_layers} layers", "experts": arch.num_experts,
            "top_k": arch.moe_router_topk, "dispatcher": arch.moe_token_dispatcher_type, "tokens": count,
            "step_seconds": seconds, "flops_per_s": flops / seconds, "matmul_flops_per_s": peak,
            "share_of_matmul": flops / seconds / peak}
