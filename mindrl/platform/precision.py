"""Whether bf16 is fast on this device, and what `bf16: auto | true | false` then trains in.

On accelerators bf16 is a capability of the device. On CPUs it is a property of the kernels torch
finds: with AMX or AVX512-BF16, oneDNN's bf16 matmul runs 2–8× its fp32 rate; on AVX2-only CPUs torch
has no fast bf16 kernel and the same matmul runs ~50× *slower* than fp32 (2 against 100–170 GFLOP/s on
one thread). oneDNN's own flag tells the two apart, and a short matmul measurement gives the ratio the
run reports, so the choice is explained by the number that made it.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

#: the matmul the CPU measurement times: large enough for a stable rate, ~15 ms in bf16 where bf16 is slow
_PROBE_SIZE = 256
#: best of this many timed runs per dtype, after one warm-up
_PROBE_RUNS = 3


@dataclass(frozen=True)
class Bf16Speed:
    """bf16 against fp32 on one device: whether bf16 is the faster (and so worth its lower precision)."""

    fast: bool
    #: what decided it, in words a run can print ("bf16 matmul 2.5 vs fp32 101 GFLOP/s on this CPU (0.02×)")
    evidence: str
    #: measured bf16 / fp32 matmul rate, where measured
    ratio: float | None = None


@dataclass(frozen=True)
class Precision:
    """What a role trains in, and the one line that says which and why."""

    bf16: bool
    line: str
    #: the config asked for bf16 where it is slow: the line is a warning
    slow_bf16: bool = False

    @property
    def params_dtype(self) -> str:
        return "bf16" if self.bf16 else "fp32"


def _rate(dtype: torch.dtype) -> float:
    """GFLOP/s of one square matmul in `dtype` on this process's threads (best of a few runs)."""
    a = torch.randn(_PROBE_SIZE, _PROBE_SIZE).to(dtype)
    b = torch.randn(_PROBE_SIZE, _PROBE_SIZE).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(_PROBE_RUNS):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * _PROBE_SIZE ** 3 / max(best, 1e-9) / 1e9


@functools.cache
def cpu_bf16_speed() -> Bf16Speed:
    """Measured once per process: bf16 is fast where its matmul outruns fp32's on these cores."""
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    bf16, fp32 = _rate(torch.bfloat16), _rate(torch.float32)
    ratio = bf16 / fp32
    kernels = "" if native else ", no native bf16 kernels"
    evidence = f"bf16 matmul {bf16:.3g} vs fp32 {fp32:.3g} GFLOP/s on this CPU, {ratio:.2g}×{kernels}"
    return Bf16Speed(native and ratio > 1.0, evidence, ratio)


def choose(setting: bool | str, speed: Bf16Speed | None, section: str = "megatron_training",
           resumed_bf16: bool | None = None) -> Precision:
    """`bf16: auto` trains in bf16 where it is fast and fp32 elsewhere, or in what the checkpoint it resumes was
    trained in (its optimizer state is laid out for that); `true` / `false` are obeyed, and `true` where bf16 is
    slow says so (MindSpeed-RL's files set it, and their users may mean it). `speed` is needed unless the
    setting is false or the run resumes under auto."""
    if setting == "auto" and resumed_bf16 is not None:
        chosen = "bf16" if resumed_bf16 else "fp32"
        return Precision(resumed_bf16, f"precision: {chosen} ({section}.bf16: auto; the checkpoint it resumes "
                                       f"was trained in {chosen})")
    if setting == "auto":
        chosen = "bf16" if speed.fast else "fp32"
        return Precision(speed.fast, f"precision: {chosen} ({section}.bf16: auto; {speed.evidence})")
    if setting and not speed.fast:  # `setting` is True here: auto and false are handled around it
        return Precision(True, f"warning: {section}.bf16 is true but bf16 is slow here ({speed.evidence}); training "
                               f"goes on in bf16 — set bf16: auto or false to train in fp32 on this machine",
                         slow_bf16=True)
    return Precision(bool(setting), f"precision: {'bf16' if setting else 'fp32'} ({section}.bf16: "
                                    f"{str(bool(setting)).lower()})")
