"""Tokens per second of the actor's compute_log_prob and update on the tiny model.

    python bench/actor_step.py [--rows 16] [--seq 256] [--repeats 3] [--tp 1] [--device auto]

Runs on `--tp` local ranks (TP only, so every rank sees all rows). Prints one JSON line:
the best of `--repeats` timings for each call; tokens = rows × seq.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from mindrl.config import ParallelConfig, load_model_arch
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker


def _measure(rank: int, rows: int, seq: int, repeats: int, tp: int) -> dict:
    arch = load_model_arch("tiny_qwen")
    cfg = ActorConfig(lr=1e-5, mini_batch_size=rows, micro_batch_size=min(rows, 4))
    worker = ActorWorker(arch, ParallelConfig(tp, 1), cfg, weights=sharding.random_full_state_dict(arch))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.padded_vocab_size, (rows, seq), generator=gen)
    mask = torch.zeros(rows, seq)
    mask[:, seq // 4:-1] = 1
    batch = {"tokens": tokens, "loss_mask": mask}
    times = {"log_prob": [], "update": []}
    for _ in range(repeats):
        start = time.perf_counter()
        old = worker.compute_log_prob(batch)["log_probs"]
        times["log_prob"].append(time.perf_counter() - start)
        update = {**batch, "old_log_probs": old, "advantages": torch.randn(rows, 1, generator=gen).expand(rows, seq)}
        start = time.perf_counter()
        worker.update(update)
        times["update"].append(time.perf_counter() - start)
    return {k: min(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    best = run_ranks(_measure, args.tp, args.rows, args.seq, args.repeats, args.tp, device=args.device)[0]
    tokens = args.rows * args.seq
    print(json.dumps({"bench": "actor_step", "model": "tiny_qwen", "tp": args.tp, "rows": args.rows,
                      "seq": args.seq, "log_prob_s": round(best["log_prob"], 3),
                      "log_prob_tokens_per_s": round(tokens / best["log_prob"]),
                      "update_s": round(best["update"], 3), "update_tokens_per_s": round(tokens / best["update"]),
                      "update_vs_log_prob": round(best["update"] / best["log_prob"], 2)}))


if __name__ == "__main__":
    main()
