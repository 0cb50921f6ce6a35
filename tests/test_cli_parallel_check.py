"""cli/parallel_check.py rejects a bad request in one sentence before spawning anything."""

import subprocess
import sys
import time
from pathlib import Path

CLI = Path(__file__).resolve().parents[1] / "cli" / "parallel_check.py"


def test_bad_world_size_is_one_sentence_and_exit_2():
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(CLI), "--world-size", "3"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == "error: --world-size must be an even number >= 2, got 3."
    assert "[parallel_check]" not in out.stdout
    assert time.perf_counter() - start < 60


def test_unknown_model_names_the_known_ones():
    out = subprocess.run([sys.executable, str(CLI), "--model", "nope"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "no model architecture named 'nope'" in out.stderr and "tiny_qwen" in out.stderr
