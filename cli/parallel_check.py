"""Show that mindrl's Megatron model gives the same numbers under every parallel layout.

    python cli/parallel_check.py [--model tiny_qwen] [--world-size 4] [--device auto] [--steps 4]

Builds `--model` with seeded weights on `--world-size` local ranks, runs one batch at
TP=1, TP=2, PP=2, TP=2×PP=2 and an uneven PP split (those the world size allows),
compares logits, loss and gradients with TP=1, then trains `--steps` steps with Megatron's
distributed optimizer at DP=2 and checks the replicas stay identical. Exit code 0 only
if every check passes. Layout mistakes are reported before any process starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from mindrl.config import ConfigError, ParallelConfig, load_model_arch, validate_parallel
from mindrl.launch import run_ranks
from mindrl.models.parity import join_layout, run_layouts, train_replicas

TOLERANCE = 1e-5


def candidate_layouts(num_layers: int) -> dict[str, ParallelConfig]:
    uneven = f"{num_layers - 1},1" if num_layers > 2 else None
    layouts = {"TP=1": ParallelConfig(1, 1), "TP=2": ParallelConfig(2, 1), "PP=2": ParallelConfig(1, 2),
               "TP=2xPP=2": ParallelConfig(2, 2)}
    if uneven:
        layouts[f"PP=2 ({uneven})"] = ParallelConfig(1, 2, num_layer_list=uneven)
    return layouts


def _layouts_rank(rank: int, model: str, layouts: list[ParallelConfig]) -> list:
    return run_layouts(rank, load_model_arch(model), layouts)


def _train_rank(rank: int, model: str, steps: int):
    return train_replicas(rank, load_model_arch(model), ParallelConfig(1, 1), steps=steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny_qwen", help="architecture name in configs/model/")
    parser.add_argument("--world-size", type=int, default=4, help="local ranks to spawn (>= 2)")
    parser.add_argument("--device", default=None,
                        help="auto | cpu | cuda | npu (default: MINDRL_DEVICE, else auto)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps of the DP=2 check")
    args = parser.parse_args(argv)

    try:
        arch = load_model_arch(args.model)
        if args.world_size < 2 or args.world_size % 2:
            raise ConfigError(f"--world-size must be an even number >= 2, got {args.world_size}.")
        layouts = {}
        for name, par in candidate_layouts(arch.num_layers).items():
            if args.world_size % (par.tp * par.pp) == 0:
                validate_parallel(arch, par, args.world_size)
                layouts[name] = par
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    print(f"[parallel_check] {arch.name}: {arch.num_layers} layers, hidden {arch.hidden_size}, "
          f"{arch.num_attention_heads} heads / {arch.query_groups} groups, on {args.world_size} ranks",
          flush=True)
    start = time.perf_counter()
    per_rank = run_ranks(_layouts_rank, args.world_size, args.model, list(layouts.values()),
                         device=args.device)
    joined = {name: join_layout([ranks[i] for ranks in per_rank], arch, par)
              for i, (name, par) in enumerate(layouts.items())}
    ref_logits, ref_losses, ref_grads = joined["TP=1"]
    failures = 0
    print(f"{'layout':<16}{'max|dlogits|':>14}{'max|dloss|':>12}{'max|dgrad|':>12}  result")
    report = {}
    for name, (logits, losses, grads) in joined.items():
        d_logits = (logits - ref_logits).abs().max().item()
        d_loss = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        d_grad = max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
        ok = max(d_logits, d_loss, d_grad) <= TOLERANCE
        failures += not ok
        report[name] = {"dlogits": d_logits, "dloss": d_loss, "dgrad": d_grad}
        print(f"{name:<16}{d_logits:>14.2e}{d_loss:>12.2e}{d_grad:>12.2e}  {'ok' if ok else 'MISMATCH'}")

    trained = run_ranks(_train_rank, 2, args.model, args.steps, device=args.device)
    same = all(torch.equal(trained[0].params[k], trained[1].params[k]) for k in trained[0].params)
    losses = trained[0].losses
    learned = losses[-1] < losses[0]
    failures += not (same and learned)
    print(f"DP=2 distributed optimizer, {args.steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"replicas {'identical' if same else 'DIFFER'}  {'ok' if same and learned else 'FAILED'}")
    print(json.dumps({"check": "parallel_parity", "model": arch.name, "layouts": report,
                      "dp2_losses": losses, "dp2_replicas_identical": same, "failures": failures,
                      "seconds": round(time.perf_counter() - start, 1)}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
