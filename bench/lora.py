"""LoRA against full fine-tuning on one actor: optimizer state, peak memory, update time, and share_backbone's
reference against a second model.

    python bench/lora.py [--model small_qwen] [--rows 8] [--seq 256] [--repeats 3] [--r 8]

Each configuration runs in a fresh rank process (one CPU rank, fp32), so its peak resident memory is its own:
  full      the actor trained in full, with a reference model beside it (what GRPO with a KL holds)
  lora      the actor with adapters on linear_qkv/proj/fc1/fc2, and share_backbone's reference (no second model)
Printed as one JSON line: optimizer state bytes (fp32 master copies and Adam's moments the distributed optimizer
holds), trained parameters, peak RSS after an update and a reference pass, the best update time of `--repeats`,
and the achieved FLOP/s of the update beside a plain fp32 matmul's on the same core.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from mindrl.config import ParallelConfig, load_model_arch
from mindrl.config.lora import TARGETS, LoraConfig
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker, BackboneReference, MegatronWorker


def _optimizer_bytes(actor: ActorWorker) -> int:
    """What the optimizer keeps: its fp32 parameters (master copies) and every tensor of their state."""
    total = 0
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                total += param.numel() * param.element_size()
                total += sum(v.numel() * v.element_size() for v in opt.optimizer.state.get(param, {}).values()
                             if torch.is_tensor(v))
    return total


def _measure(rank: int, model: str, lora_r: int, rows: int, seq: int, repeats: int) -> dict:
    arch = load_model_arch(model)
    lora = LoraConfig(TARGETS, lora_r, 2.0 * lora_r) if lora_r else LoraConfig()
    cfg = ActorConfig(lr=1e-4, mini_batch_size=rows, micro_batch_size=min(rows, 4), lora=lora)
    full = sharding.random_full_state_dict(arch, seed=1)
    actor = ActorWorker(arch, ParallelConfig(1, 1), cfg, weights=full)
    reference = BackboneReference(actor, 4) if lora_r else MegatronWorker(arch, ParallelConfig(1, 1), full)
    del full
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.padded_vocab_size, (rows, seq), generator=gen)
    mask = torch.zeros(rows, seq)
    mask[:, seq // 4:-1] = 1
    batch = {"tokens": tokens, "loss_mask": mask,
             "advantages": (torch.randn(rows, 1, generator=gen).expand(rows, seq) * mask).contiguous()}
    times = []
    for _ in range(repeats):
        reference.compute_log_prob(batch)
        start = time.perf_counter()
        actor.update(batch)
        times.append(time.perf_counter() - start)
    trained = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    return {"optimizer_bytes": _optimizer_bytes(actor), "trained_params": trained,
            "params": sum(p.numel() for p in actor.model.parameters()), "update_s": min(times),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def matmul_rate(rank: int) -> float:
    """A plain fp32 1024³ matmul's FLOP/s on this rank's core: the yardstick of the achieved rates."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    return 10 * 2 * 1024 ** 3 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small_qwen")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--r", type=int, default=8)
    args = parser.parse_args()
    full = run_ranks(_measure, 1, args.model, 0, args.rows, args.seq, args.repeats)[0]
    lora = run_ranks(_measure, 1, args.model, args.r, args.rows, args.seq, args.repeats)[0]
    matmul = run_ranks(matmul_rate, 1)[0]
    # forward 2·N·tokens and backward 4·N·tokens of FLOPs for the full update; LoRA skips the base's weight
    # gradients (2·N·tokens), so its update does 4·N·tokens of useful work
    tokens = args.rows * args.seq
    flops = {"full": 6 * full["params"] * tokens, "lora": 4 * lora["params"] * tokens}
    out = {"bench": "lora", "model": args.model, "r": args.r, "rows": args.rows, "seq": args.seq,
           "matmul_gflops": round(matmul / 1e9, 1)}
    for name, result in (("full", full), ("lora", lora)):
        out[name] = {"optimizer_mb": round(result["optimizer_bytes"] / 2 ** 20, 2),
                     "trained_params": result["trained_params"], "peak_rss_mb": round(result["peak_rss_mb"]),
                     "update_s": round(result["update_s"], 3),
                     "update_gflops": round(flops[name] / result["update_s"] / 1e9, 1)}
    out["optimizer_ratio"] = round(full["optimizer_bytes"] / lora["optimizer_bytes"], 1)
    out["update_speedup"] = round(full["update_s"] / lora["update_s"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
