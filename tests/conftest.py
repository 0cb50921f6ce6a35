"""Test-wide settings (one OpenMP thread on 2-core machines, no Ray auth, CPU device), the shared tiny data, the
quick tier (`--quick`: every test not marked `job`) and the time-by-file table every run ends with."""

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("MINDRL_DEVICE", "cpu")

import sys
import time
from collections import defaultdict

import pytest
import torch

#: seconds per test file (set-up, call and tear-down of its tests, session fixtures counted where first used)
_FILE_SECONDS: dict[str, float] = defaultdict(float)
_FILE_TESTS: dict[str, int] = defaultdict(int)
_STARTED = time.monotonic()
#: how many of the slowest files the end-of-run table shows
SLOWEST_FILES = 25


def _has_npu() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return torch.npu.is_available()


#: programs whose start from the test process makes a test a `job` test: a Ray cluster's, a namespace of Ray nodes
_JOB_PROGRAMS = ("gcs_server", "unshare")


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="run only the tests that start no Ray job and no vLLM engine and measure no benchmark "
                          "(not marked `job` or `measures`)")


def _refuse_ray(event: str, args: tuple) -> None:
    """In the quick tier, a test that starts a Ray cluster lacks its `job` mark: say so (tests.jobs refuses its
    trainer jobs and evaluations there too). The program is matched by its name, not by any word of the command:
    the python tool's bwrap command says `--unshare-all` and starts no job."""
    if event != "subprocess.Popen":
        return
    argv = args[1]
    if os.path.basename(str(argv.split()[0] if isinstance(argv, str) else argv[0])) in _JOB_PROGRAMS:
        raise RuntimeError(f"the quick tier starts no Ray cluster, but this test runs {args[1]}; mark it "
                           f"@pytest.mark.job")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_npu = pytest.mark.skip(reason="needs an Ascend NPU with torch_npu")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "npu" in item.keywords and not _has_npu():
            item.add_marker(skip_npu)
    # modules that start jobs or measure first: with two workers, the long modules start early and the short ones
    # fill the end
    def slow(item: pytest.Item) -> bool:
        return "job" in item.keywords or "measures" in item.keywords

    heavy = {item.module.__name__ for item in items if slow(item)}
    items.sort(key=lambda item: item.module.__name__ not in heavy)
    if config.getoption("--quick"):
        left_out = [item for item in items if slow(item)]
        items[:] = [item for item in items if not slow(item)]
        config.hook.pytest_deselected(items=left_out)
        from tests import jobs as job_helpers

        job_helpers.refuse("the quick tier runs no job")
        sys.addaudithook(_refuse_ray)


@pytest.fixture(scope="session")
def tiny_math_data(tmp_path_factory):
    """The tiny tokenizer and 200 synthetic problems (180 train / 20 test), plus `eight`: 8 of the training
    prompts beside the same 20 test prompts."""
    import shutil
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
    shutil.copyfile(root / "math" / "test.parquet", root / "eight" / "test.parquet")
    return tokenizer, root


@pytest.fixture(scope="session")
def facts_pairs(tmp_path_factory):
    """The facts tokenizer and 80 preference pairs of the demo's task: 64 to train on, 16 held out."""
    import subprocess
    import sys
    from pathlib import Path

    from mindrl.data.preprocess import PreprocessConfig, preprocess

    root = tmp_path_factory.mktemp("dpo_data")
    cli = Path(__file__).resolve().parents[1] / "cli"
    subprocess.run([sys.executable, str(cli / "build_tiny_tokenizer.py"), "--out", str(root / "tok"),
                    "--task", "facts", "--vocab-size", "512", "--split-digits"], check=True, capture_output=True)
    preprocess(PreprocessConfig(output_dir=str(root / "pairs"), tokenizer_name_or_path=str(root / "tok"),
                                generator={"kind": "fact_pairs", "num_samples": 80, "seed": 1}, prompt_type="chatml",
                                is_pairwise_dataset=True, test_fraction=0.2,
                                map_keys={"prompt": "question", "chosen": "chosen", "rejected": "rejected"}))
    return root / "tok", root / "pairs"


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] += report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome == "skipped"):
        _FILE_TESTS[path] += 1


def pytest_terminal_summary(terminalreporter):
    """Where the run's time went, by file: the table docs/testing.md keeps for each CPU kind."""
    if not _FILE_SECONDS:
        return
    wall = time.monotonic() - _STARTED
    ranked = sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])
    write = terminalreporter.write_line
    terminalreporter.section(f"time by file (slowest {min(SLOWEST_FILES, len(ranked))} of {len(ranked)})")
    for path, seconds in ranked[:SLOWEST_FILES]:
        write(f"{seconds:8.1f} s  {_FILE_TESTS[path]:4d} tests  {path}")
    write(f"{sum(_FILE_SECONDS.values()):8.1f} s in tests, {wall:.1f} s wall since the session started")
