"""Timing on the device: the best of a few runs after a warm-up, and the plain matmul rate achieved FLOP/s are held
against (the check's MFU is model FLOP/s over this rate, measured in the same process)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def best_seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """The fastest of `repeats` timed calls after one untimed one (device work waited for), and the last result."""
    from mindrl.platform import get_platform

    platform = get_platform()
    result = fn()
    platform.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        platform.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, result


def matmul_flops(size: int, dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of one square `size`³ matmul in `dtype` on this process's device."""
    from mindrl.platform import get_platform

    device = get_platform().device()
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=gen).to(dtype)
    b = torch.randn(size, size, device=device, generator=gen).to(dtype)
    seconds, _ = best_seconds(lambda: torch.mm(a, b), repeats)
    return 2.0 * size ** 3 / seconds
