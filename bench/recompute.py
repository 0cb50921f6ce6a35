"""What activation recompute saves and costs: one update on 4096 tokens, packed without padding, as one sample (a
64-token prompt and its response) and as 8 samples of 512 tokens (one prompt's 8 responses), without recompute,
with full recompute (every layer, and the first half of the layers) and with selective recompute (the attention
core), each in a fresh one-rank process.

On CPU a long sample's attention runs torch's fused kernel, which keeps no score matrix, so selective recompute has
nothing to drop there; samples up to ~700 tokens (small_qwen's 8 heads) are computed as matmuls whose score
matrices the backward keeps (mindrl/models/attention.py), and those are what selective recompute drops.

Peak memory is the process's peak RSS above its RSS once the model is built (glibc returning freed blocks,
bench/allocator.py, which also slows every mode), the update's own: activations, logits, gradients and Adam's
moments (allocated at the first step, the same in every mode); the seconds are the update's. Prints one JSON line.

    python bench/recompute.py [--model small_qwen] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from allocator import ALLOCATOR_ENV, timed_peak
from long_responses import PROMPT, grpo_batch

from mindrl.config import ParallelConfig, load_model_arch
from mindrl.config.batching import Batching
from mindrl.config.recompute import Recompute
from mindrl.launch import run_ranks
from mindrl.models import sharding


def modes(layers: int) -> dict[str, Recompute]:
    return {"none": Recompute(), "full_uniform_1": Recompute("full", "uniform", 1),
            "full_block_half": Recompute("full", "block", layers // 2), "selective": Recompute("selective")}


def _rank(rank: int, model: str, tokens: int, samples: int, mode: str) -> dict:
    from mindrl.workers.megatron_worker import ActorConfig, ActorWorker

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    arch = dataclasses.replace(load_model_arch(model), max_position_embeddings=max(tokens, 1024))
    cfg = ActorConfig(lr=1e-5, mini_batch_size=1, micro_batch_size=1, batching=Batching(remove_padding=True),
                      recompute=modes(arch.num_layers)[mode])
    actor = ActorWorker(arch, ParallelConfig(1, 1), cfg, weights=sharding.random_full_state_dict(arch, seed=1))
    cfg = dataclasses.replace(cfg, mini_batch_size=samples, micro_batch_size=samples)
    response = (tokens - PROMPT) // samples
    batch = grpo_batch(arch.padded_vocab_size, [response] * samples, samples)
    seconds, peak_mib = timed_peak(lambda: actor.update(batch))
    return {"seconds": round(seconds, 2), "peak_mib": round(peak_mib, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small_qwen")
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    os.environ.update(ALLOCATOR_ENV)  # before the launcher's rank server starts: its ranks inherit it
    layers = load_model_arch(args.model).num_layers
    results = {f"{samples}_samples": {mode: run_ranks(_rank, 1, args.model, args.tokens, samples, mode)[0]
                                      for mode in modes(layers)} for samples in (1, 8)}
    print(json.dumps({"bench": "recompute", "model": args.model, "tokens": args.tokens, "layers": layers,
                      "cpu": platform.processor() or platform.machine(),
                      "omp_threads": os.environ.get("OMP_NUM_THREADS"), **results}))


if __name__ == "__main__":
    main()
