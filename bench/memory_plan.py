"""The memory plan against one rank's measured peak: an actor update (or log-prob pass) of packed long samples, at
three model sizes.

Each size runs in a fresh one-rank process: its RSS is read before the model is built, the pass runs twice (the
first update allocates Adam's moments), the peak is reset (/proc/self/clear_refs) and the second pass's peak RSS
above that first reading is the measured figure; the plan's is weights + gradients + optimizer state + activations
+ logits of the same micro-batch for an update, weights + gradient buffer + one layer's tensors + logits for a
log-prob pass (mindrl/trainer/memory_plan.py). glibc returns every freed block above 64 KiB to the system
(bench/allocator.py), so RSS follows what is live rather than what glibc keeps.
fp32 on CPU: the plan's bf16 terms and its engine, offload and communication terms are not measured here.

    python bench/memory_plan.py [--tokens 2048] [--samples 2] [--recompute none|selective|full]
                                [--what update|log_probs]

Prints one JSON line: per size, the planned and measured MiB and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

#: (hidden, layers, ffn, heads, query groups, vocabulary): three sizes of the small Qwen shape
SIZES = {"h256": (256, 4, 704, 4, 2, 4096), "h512": (512, 8, 1408, 8, 4, 8192), "h768": (768, 8, 2048, 12, 4, 16384)}
PROMPT = 64


def arch_of(size: str):
    from mindrl.config import load_model_arch

    hidden, layers, ffn, heads, groups, vocab = SIZES[size]
    return dataclasses.replace(load_model_arch("small_qwen"), name=size, hidden_size=hidden, num_layers=layers,
                               ffn_hidden_size=ffn, num_attention_heads=heads, num_query_groups=groups,
                               padded_vocab_size=vocab, max_position_embeddings=8192)


def recompute_of(name: str):
    from mindrl.config.recompute import Recompute

    return {"none": Recompute(), "selective": Recompute("selective"), "full": Recompute("full", "uniform", 1)}[name]


def planned(size: str, tokens: int, samples: int, recompute: str, what: str = "update") -> dict[str, float]:
    """The plan's terms for one fp32 rank of `size` running one micro-batch of `samples` samples: an update, or a
    log-prob pass (the grad buffer is there from the start, Adam's moments come with the first update)."""
    from mindrl.config import ParallelConfig
    from mindrl.trainer import memory_plan

    arch, par = arch_of(size), ParallelConfig(1, 1)
    params = sum(memory_plan.stage_params(arch, par, 0))
    packed = PROMPT + samples * (tokens - PROMPT)
    if what == "log_probs":
        return {"weights": params * 4, "gradients": params * 4,
                "forward": memory_plan.forward_bytes(arch, par, packed, 4, memory_plan.kernels("CPU"))}
    return {"weights": params * 4, "gradients": params * 4, "optimizer": params * 8,
            "activations": memory_plan.activation_bytes(arch, par, 0, packed, 1, recompute_of(recompute), 4,
                                                        memory_plan.kernels("CPU"), samples * PROMPT),
            "logits": memory_plan.logits_bytes(arch, 1, packed, True)}


def _rank(rank: int, size: str, tokens: int, samples: int, recompute: str, what: str) -> float:
    import torch
    from allocator import rss
    from long_responses import grpo_batch

    from mindrl.config import ParallelConfig
    from mindrl.config.batching import Batching
    from mindrl.workers.megatron_worker import ActorConfig, ActorWorker

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    arch = arch_of(size)
    baseline = rss()
    cfg = ActorConfig(lr=1e-5, mini_batch_size=samples, micro_batch_size=samples,
                      batching=Batching(remove_padding=True), recompute=recompute_of(recompute))
    actor = ActorWorker(arch, ParallelConfig(1, 1), cfg)
    batch = grpo_batch(arch.padded_vocab_size, [tokens - PROMPT] * samples, samples)
    run = actor.update if what == "update" else actor.compute_log_prob
    run(batch)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak so far (building, the first step's allocations) is forgotten
    run(batch)
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    return peak - baseline


def measure(size: str, tokens: int, samples: int, recompute: str, what: str = "update") -> float:
    """Bytes above the pre-model RSS at the second pass's peak, in a process of its own (the launcher's rank
    server must start under the allocator setting)."""
    from allocator import ALLOCATOR_ENV

    env = {**os.environ, **ALLOCATOR_ENV}
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'bench')!r}]\n"
            f"from mindrl.launch import run_ranks\nimport memory_plan\n"
            f"print(run_ranks(memory_plan._rank, 1, {size!r}, {tokens}, {samples}, {recompute!r}, {what!r})[0])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of each sample (prompt and response)")
    parser.add_argument("--samples", type=int, default=2, help="samples of one prompt in the micro-batch")
    parser.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    parser.add_argument("--what", default="update", choices=("update", "log_probs"))
    args = parser.parse_args()
    results = {}
    for size in SIZES:
        plan = planned(size, args.tokens, args.samples, args.recompute, args.what)
        measured = measure(size, args.tokens, args.samples, args.recompute, args.what)
        results[size] = {"planned_mib": round(sum(plan.values()) / 2**20, 1),
                         "measured_mib": round(measured / 2**20, 1),
                         "ratio": round(sum(plan.values()) / measured, 3),
                         "terms_mib": {k: round(v / 2**20, 1) for k, v in plan.items()}}
    print(json.dumps({"bench": "memory_plan", "what": args.what, "tokens": args.tokens, "samples": args.samples,
                      "recompute": args.recompute, "cpu": platform.processor() or platform.machine(),
                      "omp_threads": os.environ.get("OMP_NUM_THREADS"), **results}))


if __name__ == "__main__":
    main()
