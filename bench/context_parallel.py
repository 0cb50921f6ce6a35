"""What context parallelism saves and costs: one update of one 8192-token sample (a 64-token prompt and its
response), packed without padding, at CP = 1, 2 and 4, with ring attention and with Ulysses, each layout in fresh
processes (one per CP rank, each with OMP_NUM_THREADS threads).

Peak memory is each rank's peak RSS above its RSS once the model is built (glibc returning freed blocks,
bench/allocator.py), the update's own: activations, logits, gradients and Adam's moments (the last two the same at
every CP, as the CP ranks hold the same weights); the largest rank's is reported. Communication is the seconds each
rank spends in CP's own transfers (the ring's sends and receives, Ulysses' all-to-alls), from the moment it asks
for them until they are done, as a share of the update's; on CPU gloo moves them through loopback sockets. With
more CP ranks than cores the ranks also wait for each other's compute, and that wait is counted where it happens
(in the transfer), so the shares at CP4 on two cores are an upper bound. GFLOP/s counts the sample's matmul FLOPs
(mindrl/models/flops.py, × 3 for forward + backward) over the update's seconds, summed over the ranks; the plain
matmul's beside it ran on the same cores. Prints one JSON line.

    python bench/context_parallel.py [--model small_qwen] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from allocator import ALLOCATOR_ENV, timed_peak
from long_responses import PROMPT, grpo_batch
from rollout import _matmul

from mindrl.config import ParallelConfig, load_model_arch
from mindrl.config.batching import Batching
from mindrl.launch import run_ranks
from mindrl.models import context_parallel, sharding
from mindrl.models.flops import forward_flops

ALGORITHMS = {"ring": "megatron_cp_algo", "ulysses": "ulysses_cp_algo"}


def _timed(spent: list[float], fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
    return wrapper


def _rank(rank: int, model: str, tokens: int, cp: int, algo: str) -> dict:
    from mindrl.workers.megatron_worker import ActorConfig, ActorWorker

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    arch = dataclasses.replace(load_model_arch(model), max_position_embeddings=max(tokens, 1024))
    cfg = ActorConfig(lr=1e-5, mini_batch_size=1, micro_batch_size=1, batching=Batching(remove_padding=True))
    par = ParallelConfig(context_parallel_size=cp, context_parallel_algo=ALGORITHMS[algo])
    actor = ActorWorker(arch, par, cfg, weights=sharding.random_full_state_dict(arch, seed=1))
    batch = grpo_batch(arch.padded_vocab_size, [tokens - PROMPT], 1)
    spent = [0.0]
    # CP's own transfers: the ring's exchanges (started, then waited for) and the all-to-alls of both directions
    context_parallel._Shift.__init__ = _timed(spent, context_parallel._Shift.__init__)
    context_parallel._Shift.wait = _timed(spent, context_parallel._Shift.wait)
    dist.all_to_all_single = _timed(spent, dist.all_to_all_single)
    seconds, peak_mib = timed_peak(lambda: actor.update(batch))
    return {"seconds": seconds, "peak_mib": peak_mib, "communication_s": spent[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small_qwen")
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    os.environ.update(ALLOCATOR_ENV)  # before the launcher's rank server starts: its ranks inherit it
    arch = load_model_arch(args.model)
    flops = 3 * forward_flops(arch, args.tokens, args.tokens * (args.tokens + 1) / 2)
    results = {}
    for cp, algo in ((1, "ring"), (2, "ring"), (2, "ulysses"), (4, "ring"), (4, "ulysses")):
        if algo == "ulysses" and arch.query_groups % cp:
            continue
        ranks = run_ranks(_rank, cp, args.model, args.tokens, cp, algo)
        seconds = max(r["seconds"] for r in ranks)
        results["cp1" if cp == 1 else f"cp{cp}_{algo}"] = {
            "peak_mib_per_rank": round(max(r["peak_mib"] for r in ranks), 1), "seconds": round(seconds, 2),
            "communication_share": round(max(r["communication_s"] for r in ranks) / seconds, 3),
            "gflops": round(flops / seconds / 1e9, 2)}
    matmul = run_ranks(_matmul, 1, "fp32", int(os.environ.get("OMP_NUM_THREADS", "2")))[0]
    print(json.dumps({"bench": "context_parallel", "model": args.model, "tokens": args.tokens,
                      "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                      "omp_threads_per_rank": os.environ.get("OMP_NUM_THREADS"),
                      "matmul_gflops_fp32": round(matmul, 1), **results}))


if __name__ == "__main__":
    main()
