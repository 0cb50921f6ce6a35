"""The actor at a real size on the device (Qwen2.5-1.5B's shape, random weights, `bf16: auto`'s choice, the
distributed optimizer): its update and its forward (the reference's pass) in tokens/s and model FLOP/s beside the
matmul rate, the Megatron engine's decode tokens/s, and offload — device memory before, after offload and after
reload, and the weights and optimizer state bit-identical after the round trip.

The update's rows share prompts as GRPO's samples do and are packed behind one copy of each prompt (a row of
prompt + n responses, 4096 tokens on a GPU); its FLOPs are the useful ones: every token once through the weights
and each response attending to its prompt and itself, forward and backward (3×)."""

from __future__ import annotations

import torch

from tests.device.sizes import Sizes

#: offload should hand back at least this share of the actor's device memory (a goal reported, not asserted)
OFFLOAD_GOAL = 0.95


def _batch(sizes: Sizes, vocab: int) -> dict[str, torch.Tensor]:
    """`rows` prompts with `samples` responses each, the samples of a prompt side by side."""
    rows, prompt = sizes.rows * sizes.samples, sizes.prompt_tokens
    width = prompt + sizes.response_tokens
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (rows, width), generator=gen)
    for group in range(0, rows, sizes.samples):
        tokens[group:group + sizes.samples, :prompt] = tokens[group, :prompt]
    loss_mask = torch.zeros(rows, width)
    loss_mask[:, prompt - 1:width - 1] = 1
    return {"tokens": tokens, "loss_mask": loss_mask, "prompt_lengths": torch.full((rows,), prompt),
            "response_lengths": torch.full((rows,), sizes.response_tokens),
            "advantages": torch.randn(rows, 1, generator=gen) * loss_mask}


def _packed_forward_flops(arch, sizes: Sizes) -> float:
    """One packed row's useful forward FLOPs: its tokens once, the prompt causally, each response over the prompt
    and itself causally."""
    from mindrl.models.flops import forward_flops

    p, r, n = sizes.prompt_tokens, sizes.response_tokens, sizes.samples
    return forward_flops(arch, p + n * r, p * (p + 1) / 2 + n * (r * p + r * (r + 1) / 2))


def _state(worker) -> list[torch.Tensor]:
    """What a round trip through the host must bring back as it was: weights and the optimizer's tensors."""
    return [t.detach().to("cpu", copy=True) for t in [*worker.model.parameters(), *worker._optimizer_tensors()]]


def _memory() -> dict[str, int | None]:
    from mindrl.platform import get_platform

    platform = get_platform()
    platform.synchronize()
    platform.empty_cache()
    reserved = torch.cuda.memory_reserved() if torch.cuda.is_available() else None
    return {"allocated": platform.memory_allocated(), "reserved": reserved}


def _offload(worker) -> dict:
    before = _memory()
    state = _state(worker)
    freed = worker.offload()
    after = _memory()
    restored = worker.onload()
    back = _memory()
    identical = all(torch.equal(a, b.cpu()) for a, b in zip(state, _state(worker), strict=True))
    returned = (before["allocated"] - after["allocated"]) / before["allocated"] if before["allocated"] else None
    return {"memory_before": before, "memory_offloaded": after, "memory_reloaded": back, "bytes_offloaded": freed,
            "bytes_restored": restored, "share_returned": returned, "goal": OFFLOAD_GOAL,
            "bit_identical": identical, "passed": identical and restored == freed}


def _decode(worker, sizes: Sizes) -> dict:
    from mindrl.rollout.config import SamplingConfig
    from mindrl.rollout.megatron_engine import MegatronEngine
    from tests.device.timing import best_seconds

    engine = MegatronEngine(worker.model, worker.arch, worker.par, [], sizes.decode_prompt + sizes.decode_tokens,
                            max_num_seqs=sizes.decode_batch)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, worker.arch.padded_vocab_size, (sizes.decode_batch, sizes.decode_prompt),
                            generator=gen).tolist()
    greedy = SamplingConfig(top_k=1, max_tokens=sizes.decode_tokens)
    seconds, result = best_seconds(lambda: engine.generate(prompts, greedy), sizes.repeats)
    tokens = sum(len(response) for response in result.responses)
    return {"batch": sizes.decode_batch, "prompt_tokens": sizes.decode_prompt, "new_tokens": sizes.decode_tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds}


def figures(rank: int, sizes: Sizes) -> dict:
    from mindrl.config import ParallelConfig, load_model_arch
    from mindrl.workers.megatron_worker import ActorConfig, ActorWorker
    from tests.device.precision import auto_choice
    from tests.device.timing import best_seconds, matmul_flops

    bf16, precision = auto_choice(rank)
    dtype = torch.bfloat16 if bf16 else torch.float32
    arch = load_model_arch(sizes.actor_model)
    rows = sizes.rows * sizes.samples
    cfg = ActorConfig(lr=1e-6, mini_batch_size=rows, micro_batch_size=sizes.samples, prompt_packing="on")
    worker = ActorWorker(arch, ParallelConfig(1, 1), cfg, params_dtype=dtype)
    batch = _batch(sizes, arch.padded_vocab_size)
    peak = matmul_flops(sizes.matmul, dtype, sizes.repeats)
    row_flops = _packed_forward_flops(arch, sizes)
    out = {"model": sizes.actor_model, "precision": precision, "dtype": str(dtype).removeprefix("torch."),
           "packed_rows": sizes.rows, "packed_row_tokens": sizes.packed_row_tokens,
           "matmul": {"size": sizes.matmul, "flops_per_s": peak}}
    for name, flops, call in (("update", 3 * row_flops, lambda: worker.update(batch)),
                              ("forward", row_flops, lambda: worker.compute_log_prob(batch))):
        seconds, _ = best_seconds(call, sizes.repeats)
        achieved = flops * sizes.rows / seconds
        out[name] = {"seconds": seconds, "tokens_per_s": sizes.packed_row_tokens * sizes.rows / seconds,
                     "flops_per_s": achieved, "mfu": achieved / peak, "packed": worker.packed}
    out["decode"] = _decode(worker, sizes)
    out["offload"] = _offload(worker)
    return out
