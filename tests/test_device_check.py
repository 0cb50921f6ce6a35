"""The prepared device check's dry run (`bash scripts/device_check.sh --device cpu`): every check passes at tiny
sizes on this CPU with what the lent GPU image lacks made absent (Ray, vLLM, Hydra, math-verify, pydantic, …), and
writes its JSON and log, so the script cannot rot between the sessions that hold a GPU."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: modules this environment has and the lent GPU image lacks (its package list, docs/platforms.md), that mindrl or
#: its libraries could reach: the check must run with each of them absent (megatron-core and OmegaConf travel as
#: wheels, scripts/device_wheels.sh)
ABSENT = ("ray", "vllm", "hydra", "math_verify", "latex2sympy2_extended", "pydantic", "pydantic_core", "zmq",
          "msgspec", "cachetools", "jsonschema", "dill", "loguru", "lark", "fastapi", "starlette", "uvicorn",
          "openai", "anthropic", "xgrammar", "compressed_tensors", "mistral_common", "blake3", "setproctitle",
          "sentry_sdk", "tzdata", "cryptography", "annotated_types", "opentelemetry", "websockets")
CHECKS = {"gpu_tests", "hf_parity", "engine", "precision", "actor", "moe_stack"}
#: imported at start-up by every Python that has its folder on PYTHONPATH (the script's and each rank's): the
#: import system then finds none of ABSENT, as where it is not installed (find_spec says None; import raises
#: ModuleNotFoundError)
SITECUSTOMIZE = """
import sys

ABSENT = frozenset({absent!r})


class Absent:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [Absent(finder) for finder in sys.meta_path]
"""


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("device_check")
    (root / "absent").mkdir()
    (root / "absent" / "sitecustomize.py").write_text(SITECUSTOMIZE.format(absent=ABSENT))
    env = dict(os.environ, PYTHONPATH=str(root / "absent"))
    run = subprocess.run(["bash", "scripts/device_check.sh", "--device", "cpu", "--out", str(root / "out")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    results = root / "out" / "device_check.json"
    assert results.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    return run, json.loads(results.read_text()), (root / "out" / "device_check.log").read_text()


def test_every_check_passes_in_the_dry_run(dry_run):
    run, results, log = dry_run
    failed = {name: result.get("error") for name, result in results["checks"].items() if not result["passed"]}
    assert run.returncode == 0 and not failed, (failed, run.stdout[-3000:], run.stderr[-3000:])
    assert set(results["checks"]) == CHECKS
    assert f"device check: {len(CHECKS)} of {len(CHECKS)} passed" in log
    assert results["machine"]["device"] == "cpu" and results["machine"]["megatron_core"]


def test_the_dry_run_measures_what_a_gpu_run_reports(dry_run):
    checks = dry_run[1]["checks"]
    # without CUDA every GPU test is collected and skipped
    assert checks["gpu_tests"]["tests"] >= 4 and checks["gpu_tests"]["skipped"] == checks["gpu_tests"]["tests"]
    for name in ("dense", "moe", "vision_language"):
        model = checks["hf_parity"][name]
        assert model["fp32"]["logits"] <= 1e-4 and model["fp32"]["grads"] <= 1e-4, (name, model)
        assert 0 < model["hf_bf16"]["logits"] and model["bf16"]["logits"] <= model["bf16"]["limit"]["logits"]
    assert checks["engine"]["greedy_equals_hf"] and checks["engine"]["log_prob_max_diff"] <= 1e-5
    actor = checks["actor"]
    assert actor["update"]["packed"] and actor["update"]["mfu"] > 0 and actor["forward"]["tokens_per_s"] > 0
    assert actor["decode"]["tokens_per_s"] > 0 and actor["offload"]["bit_identical"]
    assert actor["offload"]["bytes_offloaded"] > 0 and actor["precision"].startswith("precision: ")
    assert checks["moe_stack"]["flops_per_s"] > 0 and checks["moe_stack"]["share_of_matmul"] > 0


def test_a_python_without_megatron_and_no_wheels_is_one_sentence(tmp_path):
    env = dict(os.environ, MINDRL_VENV=str(tmp_path / "none"), PATH=f"{tmp_path}:{os.environ['PATH']}")
    (tmp_path / "python3").write_text("#!/bin/sh\nexit 1\n")  # a Python that cannot import megatron.core
    (tmp_path / "python3").chmod(0o755)
    run = subprocess.run(["bash", "scripts/device_check.sh", "--wheels", str(tmp_path / "wheels")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    message = run.stderr.strip()
    assert "\n" not in message and "has no megatron-core" in message and "scripts/device_wheels.sh" in message
