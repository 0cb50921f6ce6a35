"""What a checkpoint costs the training loop: the seconds an actor waits for a save (legacy per-rank files,
torch_dist, torch_dist written in the background) and for a torch_dist load at another layout.

Two CPU ranks hold small_qwen at TP=2 after one update; each format saves the same state twice (--repeats), the
median taken; the async figure is the time save_checkpoint takes to return (the writes then go on in threads) and
`async_publish_s` the wait for them at the end. The load reads the torch_dist checkpoint at TP=1 × DP=2.
Prints one JSON line.

    python bench/checkpoint_save.py [--model small_qwen] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from mindrl.config import ParallelConfig, load_model_arch
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker


def _batch(vocab: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    rows, seq = 4, 64
    mask = torch.zeros(rows, seq)
    mask[:, 16:] = 1
    return {"tokens": torch.randint(0, vocab, (rows, seq), generator=gen), "loss_mask": mask,
            "advantages": torch.randn(rows, 1, generator=gen).expand(rows, seq) * mask}


def _actor(model: str, par: ParallelConfig, **cfg) -> ActorWorker:
    release_model_parallel()
    arch = load_model_arch(model)
    config = dataclasses.replace(ActorConfig(lr=1e-4, mini_batch_size=4, micro_batch_size=2), **cfg)
    return ActorWorker(arch, par, config, weights=sharding.random_full_state_dict(arch, seed=1))


def _rank(rank: int, model: str, root: str, repeats: int) -> dict:
    out: dict[str, float] = {}
    vocab = load_model_arch(model).padded_vocab_size
    for name, cfg in (("legacy", {}), ("torch_dist", {"ckpt_format": "torch_dist"}),
                      ("torch_dist_async", {"ckpt_format": "torch_dist", "async_save": True})):
        actor = _actor(model, ParallelConfig(2, 1), **cfg)
        actor.update(_batch(vocab))
        waits = []
        for repeat in range(repeats):
            start = time.perf_counter()
            actor.save_checkpoint(f"{root}/{name}", repeat + 1)
            waits.append(time.perf_counter() - start)
            if cfg.get("async_save"):
                start = time.perf_counter()
                actor.finish_saves()
                out["async_publish_s"] = time.perf_counter() - start
        out[f"{name}_save_s"] = statistics.median(waits)
    resharded = _actor(model, ParallelConfig(1, 1), ckpt_format="torch_dist")
    start = time.perf_counter()
    resharded.load_checkpoint(f"{root}/torch_dist", load_rng=False)
    out["torch_dist_load_tp2_to_dp2_s"] = time.perf_counter() - start
    out["parameters"] = sum(p.numel() for p in resharded.model.parameters())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small_qwen")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        result = run_ranks(_rank, 2, args.model, root, args.repeats)[0]
        sizes = {name: sum(f.stat().st_size for f in (Path(root) / name / "iter_0000001").rglob("*")
                           if f.is_file()) / 2**20 for name in ("legacy", "torch_dist")}
    print(json.dumps({"bench": "checkpoint_save", "model": args.model, "ranks": 2, "repeats": args.repeats,
                      "cpu": platform.processor() or platform.machine(), "omp_threads": os.environ.get(
                          "OMP_NUM_THREADS"), **{k: round(v, 3) if isinstance(v, float) else v
                                                 for k, v in result.items()},
                      "mib_on_disk": {k: round(v, 1) for k, v in sizes.items()}}))


if __name__ == "__main__":
    main()
