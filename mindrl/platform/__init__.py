"""The device kind this process runs on: cpu, cuda or npu.

Chosen by, in order: the `device` argument (from config), the MINDRL_DEVICE
environment variable, then auto-detection (NPU if torch_npu sees one, else CUDA if
torch does, else CPU). Nothing outside this package names a device kind.
"""

from __future__ import annotations

import os

from mindrl.platform.base import Platform
from mindrl.platform.cpu import CpuPlatform
from mindrl.platform.cuda import CudaPlatform
from mindrl.platform.npu import NpuPlatform

PLATFORMS: dict[str, type[Platform]] = {"cpu": CpuPlatform, "cuda": CudaPlatform, "npu": NpuPlatform}
#: the platform a rank runs, by the Ray resource it holds
RESOURCE_PLATFORMS = {"NPU": "npu", "GPU": "cuda", "CPU": "cpu"}
_current: Platform | None = None


def detect() -> str:
    """Name of the best device kind present."""
    for name in ("npu", "cuda"):
        if PLATFORMS[name].available():
            return name
    return "cpu"


def requested(device: str | None = None) -> str:
    """The device asked for: `device`, else MINDRL_DEVICE, else "auto" (lower case, not yet checked)."""
    return (device or os.environ.get("MINDRL_DEVICE") or "auto").lower()


def get_platform(device: str | None = None) -> Platform:
    """The platform for `device` (or MINDRL_DEVICE, or auto), set up and cached per process."""
    global _current
    name = requested(device)
    if name == "auto":
        name = _current.name if _current else detect()
    if name not in PLATFORMS:
        raise ValueError(f"unknown device {name!r}; set device / MINDRL_DEVICE to one of "
                         f"auto, {', '.join(PLATFORMS)}.")
    if _current is None or _current.name != name:
        platform = PLATFORMS[name]()
        platform.setup()
        _current = platform
    else:
        _current.setup()
    return _current


__all__ = ["PLATFORMS", "RESOURCE_PLATFORMS", "Platform", "detect", "get_platform", "requested"]
