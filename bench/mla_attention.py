"""Multi-latent attention's core on CPU: values narrower than the keys, by torch's math kernel or zero-padded to the
keys' width so torch's flash kernel takes them (what mindrl/models/attention.py does).

torch's CPU flash kernel takes one head size; scaled_dot_product_attention falls back to its math kernel for
DeepSeek-V3's heads (queries and keys of 192, values of 128), and that kernel keeps each sample's [L, L] score
matrix for the backward. Padding the values with zero columns costs (d − v)/v more work in the second matmul and
keeps no score matrix. Per method: the forward + backward's seconds (best of `--repeats`), the bytes autograd keeps
for the backward, and the achieved FLOP/s of the attention's own work (causal: half of 2·L²·heads·(d + v) forward,
twice that backward; the padding's columns not counted) beside a plain fp32 matmul's on the same cores. Prints
one JSON line.

    python bench/mla_attention.py [--length 4096] [--heads 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

QK, V = 192, 128  # DeepSeek-V3's query/key head width (128 + 64 rotated) and value width


def _core(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, padded: bool) -> torch.Tensor:
    if padded:
        return F.scaled_dot_product_attention(query, key, F.pad(value, (0, QK - V)), is_causal=True)[..., :V]
    return F.scaled_dot_product_attention(query, key, value, is_causal=True)


def measure(length: int, heads: int, padded: bool, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    query, key = (torch.randn(1, heads, length, QK, generator=gen, requires_grad=True) for _ in range(2))
    value = torch.randn(1, heads, length, V, generator=gen, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    best = float("inf")
    for _ in range(repeats):
        kept.clear()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = _core(query, key, value, padded)
        out.sum().backward()
        best = min(best, time.perf_counter() - start)
    flops = 3 * length * length * heads * (QK + V)  # causal half of 2·L²·heads·(d + v), forward + 2× backward
    return {"seconds": round(best, 4), "kept_mib": round(sum(kept.values()) / 2**20, 1),
            "gflops": round(flops / best / 1e9, 2)}


def matmul_gflops(repeats: int, size: int = 4096) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return round(2 * size**3 / best / 1e9, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="tokens of the one sample")
    parser.add_argument("--heads", type=int, default=16, help="heads on the rank (DeepSeek-V3's 128 over TP 8)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps({"bench": "mla_attention", "cpu": platform.processor() or platform.machine(),
                      "threads": torch.get_num_threads(), "length": args.length, "heads": args.heads,
                      "math": measure(args.length, args.heads, False, args.repeats),
                      "padded_flash": measure(args.length, args.heads, True, args.repeats),
                      "matmul_gflops": matmul_gflops(args.repeats)}))


if __name__ == "__main__":
    main()
