"""Test-wide settings: one OpenMP thread (2-core machines), no Ray auth, CPU device."""

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("MINDRL_DEVICE", "cpu")

import pytest
import torch


def _has_npu() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return torch.npu.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_npu = pytest.mark.skip(reason="needs an Ascend NPU with torch_npu")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "npu" in item.keywords and not _has_npu():
            item.add_marker(skip_npu)
