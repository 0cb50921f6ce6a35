"""python -m tests.device --device cuda|cpu --out DIR [--only NAME,...]: every check, one JSON.

Each check runs on its own: one that fails is written with its error and the next one runs, so a short lease
still brings back every figure that could be had. The JSON is rewritten after each check (a run stopped at its
time limit keeps what it finished)."""

from __future__ import annotations

import argparse
import datetime
import json
import platform as host
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path

import torch

from tests.device.sizes import Sizes, sizes_for

RESULTS = "device_check.json"
#: the GPU-marked tests that need neither Ray nor vLLM (one GPU: each runs at world size 1, as NCCL puts one
#: rank on a device)
GPU_TESTS = ("tests/test_gpu.py", "tests/test_rollout_megatron.py")


def gpu_tests(device: str, sizes: Sizes) -> dict:
    """pytest -m gpu over GPU_TESTS; without CUDA they are skipped, which the dry run records as such."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "junit.xml"
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                              "-o", "addopts=", f"--junitxml={report}", *GPU_TESTS],
                             capture_output=True, text=True, env=_child_env())
        suite = ElementTree.parse(report).getroot().find("testsuite") if report.exists() else None
    if suite is None:
        raise RuntimeError(f"pytest wrote no report (exit {run.returncode}): {run.stdout[-2000:]}{run.stderr[-2000:]}")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [case.get("name") for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {**counts, "failed": failed, "passed": run.returncode == 0 and not failed,
            "tail": run.stdout.strip().splitlines()[-1:] if run.stdout else []}


def _child_env() -> dict[str, str]:
    """The tests name their device themselves; pytest loads no plugin it was not asked for (a GPU image's plugins
    are not this machine's, and an installed package's plugin may need what the check runs without)."""
    import os

    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env.pop("MINDRL_DEVICE", None)
    return env


def hf_parity(device: str, sizes: Sizes) -> dict:
    from tests.device import parity

    models = parity.run(device, sizes)
    return {**models, "passed": all(m["passed"] for m in models.values())}


def engine(device: str, sizes: Sizes) -> dict:
    from tests.device import engine as check

    return check.run(device)


def precision(device: str, sizes: Sizes) -> dict:
    """`bf16: auto` on this device: bf16 on an accelerator, and the line saying so."""
    from mindrl.launch import run_ranks
    from tests.device.precision import auto_choice

    bf16, line = run_ranks(auto_choice, 1, device=device)[0]
    return {"bf16": bf16, "line": line, "passed": bf16 or device == "cpu"}


def actor(device: str, sizes: Sizes) -> dict:
    from mindrl.launch import run_ranks
    from tests.device import actor as check

    figures = run_ranks(check.figures, 1, sizes, device=device)[0]
    return {**figures, "passed": figures["offload"]["passed"]}


def moe_stack(device: str, sizes: Sizes) -> dict:
    from mindrl.launch import run_ranks
    from tests.device.moe_stack import figures

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return {**run_ranks(figures, 1, sizes, dtype, device=device)[0], "passed": True}


CHECKS: dict[str, Callable[[str, Sizes], dict]] = {
    "gpu_tests": gpu_tests, "hf_parity": hf_parity, "engine": engine, "precision": precision, "actor": actor,
    "moe_stack": moe_stack}


def _machine(device: str) -> dict:
    out = {"date": datetime.date.today().isoformat(), "device": device, "python": host.python_version(),
           "torch": torch.__version__, "cpu": host.processor() or host.machine()}
    if device == "cuda" and torch.cuda.is_available():
        out.update(card=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                   memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1))
    try:
        import megatron.core

        out["megatron_core"] = megatron.core.__version__
    except ImportError:
        out["megatron_core"] = None
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks to run, in this order")
    args = parser.parse_args()
    chosen = [name for name in args.only.split(",") if name]
    unknown = sorted(set(chosen) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device here; run --device cpu for the dry run")
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = sizes_for(args.device)
    results = {"machine": _machine(args.device), "checks": {}}
    started = time.perf_counter()
    for name in chosen:
        print(f"device check: {name} ...", flush=True)
        start = time.perf_counter()
        try:
            result = CHECKS[name](args.device, sizes)
        except Exception as err:  # every check reports, whatever one of them raised
            result = {"passed": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - start, 1)
        results["checks"][name] = result
        results["seconds"] = round(time.perf_counter() - started, 1)
        (args.out / RESULTS).write_text(json.dumps(results, indent=1, default=str))
        print(f"device check: {name} {'passed' if result['passed'] else 'FAILED'} in {result['seconds']} s",
              flush=True)
    failed = [name for name, result in results["checks"].items() if not result["passed"]]
    print(f"device check: {len(chosen) - len(failed)} of {len(chosen)} passed in {results['seconds']} s; "
          f"results in {args.out / RESULTS}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
