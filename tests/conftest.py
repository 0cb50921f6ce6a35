"""Test-wide settings (one OpenMP thread on 2-core machines, no Ray auth, CPU device) and the shared tiny data."""

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


@pytest.fixture(scope="session")
def tiny_math_data(tmp_path_factory):
    """The tiny tokenizer and 200 synthetic problems (180 train / 20 test), plus an 8-prompt train split."""
    import subprocess
    import sys
    from pathlib import Path

    import pyarrow.parquet as pq

    from mindrl.data.preprocess import PreprocessConfig, preprocess

    cli = Path(__file__).resolve().parents[1] / "cli"
    root = tmp_path_factory.mktemp("grpo_data")
    tokenizer = root / "tokenizer"
    subprocess.run([sys.executable, str(cli / "build_tiny_tokenizer.py"), "--out", str(tokenizer)],
                   check=True, capture_output=True)
    preprocess(PreprocessConfig(output_dir=str(root / "math"), tokenizer_name_or_path=str(tokenizer),
                                generator={"kind": "mixed", "num_samples": 200, "seed": 0}, prompt_type="qwen_r1",
                                map_keys={"prompt": "question", "answer": "answer"}, data_source="synthetic_math",
                                test_fraction=0.1))
    (root / "eight").mkdir()
    pq.write_table(pq.read_table(root / "math" / "train.parquet").slice(0, 8), root / "eight" / "train.parquet")
    return tokenizer, root
