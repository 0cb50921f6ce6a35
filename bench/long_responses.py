"""Long-tailed responses through the actor's log-prob pass and update: real tokens/s and peak memory for padded rows,
today's prompt packing, padding-free packed micro-batches, and packed micro-batches cut by a token budget; beside a
batch of uniform length with the same real tokens, and a plain matmul's GFLOP/s on the same cores.

The batch is GRPO's: `--prompts` prompts of 64 tokens with `--samples` responses each. Long-tailed lengths are
the quantiles of a lognormal with median 128 and p99 = 16 × the median (σ = ln 16 / 2.326), capped at `--cap`;
the uniform batch gives every response the long-tailed batch's mean. Each (batch, mode, pass) runs in a fresh
one-rank process:
peak memory is that process's peak RSS above its RSS once the model is built (the pass's activations, logits and
gradients). GFLOP/s counts the real tokens' matmul FLOPs (mindrl/models/flops.py; × 3 for forward + backward).
Prints one JSON line.

    python bench/long_responses.py [--model small_qwen] [--prompts 2] [--samples 16] [--cap 4096] [--budget 1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from allocator import timed_peak
from rollout import _matmul

from mindrl.config import ParallelConfig, load_model_arch
from mindrl.config.batching import Batching
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.models.flops import forward_flops

PROMPT, MEDIAN = 64, 128
SIGMA = math.log(16) / 2.326  # p99 / median = exp(2.326 σ) = 16


def response_lengths(kind: str, rows: int, cap: int, seed: int = 0) -> list[int]:
    """The lognormal's quantiles at (i + ½) / rows, so a small batch still holds its tail, in a seeded order (the
    long ones fall into different prompts' groups); uniform: their mean, everywhere."""
    quantiles = torch.special.ndtri((torch.arange(rows) + 0.5) / rows)
    tail = (MEDIAN * torch.exp(SIGMA * quantiles)).round().clamp(1, cap - PROMPT).long()
    tail = tail[torch.randperm(rows, generator=torch.Generator().manual_seed(seed))]
    if kind == "long_tail":
        return tail.tolist()
    return [round(tail.float().mean().item())] * rows


def grpo_batch(vocab: int, lengths: list[int], samples: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    rows, width = len(lengths), PROMPT + max(lengths)
    tokens = torch.zeros(rows, width, dtype=torch.long)
    loss_mask = torch.zeros(rows, width)
    for row, length in enumerate(lengths):
        if row % samples == 0:
            prompt = torch.randint(1, vocab, (PROMPT,), generator=gen)
        tokens[row, :PROMPT] = prompt
        tokens[row, PROMPT:PROMPT + length] = torch.randint(1, vocab, (length,), generator=gen)
        loss_mask[row, PROMPT - 1:PROMPT + length - 1] = 1
    advantages = torch.randn(rows, 1, generator=gen).expand(rows, width) * loss_mask
    return {"tokens": tokens, "loss_mask": loss_mask, "advantages": advantages,
            "old_log_probs": torch.full((rows, width), -7.0), "prompt_lengths": torch.full((rows,), PROMPT),
            "response_lengths": torch.tensor(lengths)}


MODES = {"padded": ("off", Batching()), "prompt_packed": ("on", Batching()),
         "packed": ("auto", Batching(remove_padding=True)), "packed_budget": ("auto", None)}


def _rank(rank: int, model: str, lengths: list[int], samples: int, mode: str, what: str, budget: int,
          micro: int) -> dict:
    from mindrl.workers.megatron_worker import ActorConfig, ActorWorker

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    arch = dataclasses.replace(load_model_arch(model), max_position_embeddings=8192)
    packing, batching = MODES[mode]
    batching = batching or Batching(remove_padding=True, max_tokens=budget)
    cfg = ActorConfig(lr=1e-5, mini_batch_size=len(lengths), micro_batch_size=micro, prompt_packing=packing,
                      batching=batching)
    actor = ActorWorker(arch, ParallelConfig(1, 1), cfg, weights=sharding.random_full_state_dict(arch, seed=1))
    batch = grpo_batch(arch.padded_vocab_size, lengths, samples)
    run = actor.compute_log_prob if what == "log_probs" else actor.update
    seconds, peak_mib = timed_peak(lambda: run(batch))
    return {"seconds": seconds, "peak_mib": peak_mib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small_qwen")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--cap", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=4, help="rows per micro-batch where no budget cuts them")
    args = parser.parse_args()
    arch = load_model_arch(args.model)
    rows = args.prompts * args.samples
    results: dict[str, dict] = {}
    for kind in ("long_tail", "uniform"):
        lengths = response_lengths(kind, rows, args.cap)
        real = sum(lengths) + PROMPT * rows  # each row's tokens as the rows have them
        pairs = sum((PROMPT + n) * (PROMPT + n + 1) / 2 for n in lengths)
        flops = forward_flops(arch, real, pairs)
        results[kind] = {"response_lengths": {"median": sorted(lengths)[rows // 2], "max": max(lengths),
                                              "mean": round(sum(lengths) / rows, 1)}, "real_tokens": real}
        modes = MODES if kind == "long_tail" else ("padded", "packed")
        for mode in modes:
            for what in ("log_probs", "update"):
                out = run_ranks(_rank, 1, args.model, lengths, args.samples, mode, what, args.budget, args.micro)[0]
                work = flops * (3 if what == "update" else 1)
                results[kind][f"{mode}_{what}"] = {"tokens_per_s": round(real / out["seconds"], 1),
                                                   "gflops": round(work / out["seconds"] / 1e9, 2),
                                                   "peak_mib": round(out["peak_mib"], 1)}
    matmul = run_ranks(_matmul, 1, "fp32", int(os.environ.get("OMP_NUM_THREADS", "2")))[0]
    print(json.dumps({"bench": "long_responses", "model": args.model, "rows": rows, "prompt": PROMPT,
                      "cap": args.cap, "budget": args.budget, "micro_batch_rows": args.micro,
                      "cpu": platform.processor() or platform.machine(),
                      "omp_threads": os.environ.get("OMP_NUM_THREADS"), "matmul_gflops_fp32": round(matmul, 1),
                      **results}))


if __name__ == "__main__":
    main()
