"""The README's layout holds: import-linter's contracts in pyproject.toml, on the code and on planted breaks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import jobs

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    """import-linter over the `mindrl` package found first on the path from `tree`, with the project's contracts."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT), "--no-cache", "--config", str(ROOT / "pyproject.toml")], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=jobs.COMMAND_LIMIT_S)


@pytest.fixture
def copy(tmp_path) -> Path:
    shutil.copytree(ROOT / "mindrl", tmp_path / "mindrl", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_the_code_keeps_every_contract():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_an_import_from_a_package_drawn_above_breaks_the_layers(copy):
    with (copy / "mindrl" / "models" / "gpt.py").open("a") as f:
        f.write("\nfrom mindrl.trainer import metrics  # noqa: E402,F401\n")
    done = _lint(copy)
    assert done.returncode == 1
    assert "mindrl.models is not allowed to import mindrl.trainer" in done.stdout
    assert "mindrl.models.gpt -> mindrl.trainer.metrics" in done.stdout


def test_two_modules_importing_each_other_break_the_cycle_contract(copy):
    package = copy / "mindrl" / "config"
    (package / "first.py").write_text("from mindrl.config import second  # noqa: F401\n")
    (package / "second.py").write_text("from mindrl.config import first  # noqa: F401\n")
    done = _lint(copy)
    assert done.returncode == 1
    assert "Packages import only those drawn below them KEPT" in done.stdout
    assert "No cycles are allowed in mindrl.config" in done.stdout


def test_an_import_only_for_type_checking_counts(copy):
    with (copy / "mindrl" / "checkpoint" / "atomic.py").open("a") as f:
        f.write("\nfrom typing import TYPE_CHECKING  # noqa: E402\n\nif TYPE_CHECKING:\n"
                "    from mindrl.workers.megatron_worker import ActorWorker  # noqa: F401\n")
    done = _lint(copy)
    assert done.returncode == 1
    assert "mindrl.checkpoint is not allowed to import mindrl.workers" in done.stdout
