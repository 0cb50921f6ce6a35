"""tools/ckpt_convert/: one hf2mcore / mcore2hf recipe per architecture, at the layout its trainer config trains.

The recipes' defaults are read with DRY_RUN=1 (the command they would run) and compared with the trainer
configs, so changing a config's TP/PP, checkpoint folders or tokenizer without its recipe fails here.
"""

import functools
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mindrl.checkpoint import megatron as mg
from mindrl.config import ParallelConfig, load_model_arch, validate_parallel
from mindrl.models.hf_mapping import model_type_hf_of
from mindrl.trainer.config import TRAINER_CONFIGS_DIR, load_trainer_config
from mindrl.trainer.sft_config import SFT_CONFIGS_DIR, load_sft_config
from tests import jobs

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "tools" / "ckpt_convert"
ARCHS = sorted(p.stem for p in (ROOT / "configs" / "model").glob("*.yaml"))
PAIR = ("hf2mcore.sh", "mcore2hf.sh")
# what the recipes read from the environment: a value set by whoever runs the tests must not leak in
RECIPE_ENV = ("HF_DIR", "MG_DIR", "HF_OUT", "MG_OUT", "TP", "PP", "DTYPE", "NUM_LAYER_LIST", "HF_CONFIG_DIR",
              "TOKENIZER", "PYTHON", "DRY_RUN")


def run_recipe(script: Path, dry_run: bool = False, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in RECIPE_ENV}
    clean.update(env, PYTHON=sys.executable, **({"DRY_RUN": "1"} if dry_run else {}))
    # from another folder: the recipe must find the repository by its own path
    out = subprocess.run(["bash", str(script), "--no-progress"], env=clean, cwd=script.parent, capture_output=True,
                         text=True, timeout=jobs.COMMAND_LIMIT_S)
    assert out.returncode == 0, f"{script.relative_to(ROOT)}: {out.stderr}"
    return out


def flags(script: Path, **env: str) -> dict[str, str | bool]:
    """The cli/convert_ckpt.py flags a recipe passes by default (a flag without a value maps to True)."""
    argv = shlex.split(run_recipe(script, dry_run=True, **env).stdout)
    assert argv[:2] == [sys.executable, "cli/convert_ckpt.py"], argv
    out: dict[str, str | bool] = {}
    for i, arg in enumerate(argv[2:], start=2):
        if arg.startswith("--"):
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            out[arg[2:]] = True if following.startswith("--") else following
    return out


@functools.cache
def trainers() -> dict[str, list[tuple[str, object]]]:
    """architecture -> [(config file, its actor section)] over the shipped GRPO and SFT configs."""
    found: dict[str, list[tuple[str, object]]] = {}
    for path in sorted(TRAINER_CONFIGS_DIR.glob("*.yaml")):
        actor = load_trainer_config(path.stem).actor_config
        found.setdefault(actor.model, []).append((f"rlxf/{path.name}", actor))
    for path in sorted(SFT_CONFIGS_DIR.glob("*.yaml")):
        training = load_sft_config(path.stem).training
        found.setdefault(training.model, []).append((f"sft/{path.name}", training))
    return found


def same_path(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.normpath(a) == os.path.normpath(b)


def test_every_architecture_has_its_recipe_pair():
    recipes = sorted(p.name for p in RECIPES.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    assert recipes == ARCHS, "tools/ckpt_convert/ needs one folder per configs/model/*.yaml, and no other"
    for arch in ARCHS:
        for name in PAIR:
            script = RECIPES / arch / name
            assert script.is_file() and os.access(script, os.X_OK), f"{script.relative_to(ROOT)}: missing or not +x"
    assert not list(RECIPES.rglob("__init__.py")), "tools/ckpt_convert/ is scripts, not a package"


@pytest.mark.parametrize("script", sorted(RECIPES.rglob("*.sh")), ids=lambda p: str(p.relative_to(RECIPES)))
def test_script_parses(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("arch_name", ARCHS)
def test_recipe_defaults_follow_the_trainer_configs(arch_name):
    arch = load_model_arch(arch_name)
    to_mg, to_hf = flags(RECIPES / arch_name / "hf2mcore.sh"), flags(RECIPES / arch_name / "mcore2hf.sh")
    layout = (int(to_mg["target-tensor-parallel-size"]), int(to_mg["target-pipeline-parallel-size"]),
              to_mg.get("num-layer-list"), int(to_mg.get("target-expert-parallel-size", 1)))
    assert to_mg["model-type-hf"] == model_type_hf_of(arch)
    assert to_mg.get("add-qkv-bias", False) == arch.add_qkv_bias
    users = trainers().get(arch_name, [])
    if not users:  # nothing trains it: the recipe's layout must at least be one the model accepts
        validate_parallel(arch, ParallelConfig(*layout[:3], expert_model_parallel_size=layout[3]))
        # the published weights' own dtype; a tiny (CPU-sized) model has none and trains in fp32
        assert to_mg["params-dtype"] == ("fp32" if arch_name.startswith("tiny_") else "bf16")
        assert same_path(to_hf["load-dir"], to_mg["save-dir"])
        return
    saves = {cfg.save for _, cfg in users}
    for name, cfg in users:
        par = cfg.parallel
        trained = (par.tp, par.pp, ",".join(map(str, par.num_layer_list)) if par.num_layer_list else None, par.ep)
        assert layout == trained, f"{name} trains TP,PP,layers={trained}; the recipe converts to {layout}"
        assert to_mg["params-dtype"] == ("bf16" if cfg.bf16 is True else "fp32"), name
        if cfg.load is not None and not any(same_path(cfg.load, s) for s in saves):  # loads converted weights
            assert same_path(to_mg["save-dir"], cfg.load), f"{name} loads {cfg.load}"
    grpo = [cfg for name, cfg in users if name.startswith("rlxf/")]
    assert any(same_path(to_hf["load-dir"], cfg.save) for cfg in grpo), "mcore2hf exports what GRPO saves"
    assets = to_hf.get("hf-config-dir") or to_hf.get("tokenizer-model")
    assert any(same_path(assets, cfg.tokenizer_name_or_path) for cfg in grpo), "the run's tokenizer"


def test_tiny_round_trip_through_the_recipes_is_bit_exact(tmp_path):
    """random HF tiny_qwen -> hf2mcore.sh (its trainer's layout) -> reshard.sh (TP=2, PP 1,3) -> mcore2hf.sh."""
    sys.path.insert(0, str(RECIPES))
    sys.dont_write_bytecode, previous = True, sys.dont_write_bytecode  # no __pycache__ among the recipes
    try:
        import random_hf
    finally:
        sys.path.remove(str(RECIPES))
        sys.dont_write_bytecode = previous
    source = random_hf.build("tiny_qwen", tmp_path / "hf")
    mg_dir, resharded, out = tmp_path / "mg", tmp_path / "mg_tp2pp2", tmp_path / "out"
    run_recipe(RECIPES / "tiny_qwen" / "hf2mcore.sh", HF_DIR=str(source), MG_DIR=str(mg_dir))
    actor = load_trainer_config("grpo_tiny_cpu").actor_config
    mg.check_checkpoint(mg_dir, mg.read_tracker(mg_dir), actor.arch, actor.parallel)  # the trainer would load it
    run_recipe(RECIPES / "reshard.sh", MG_DIR=str(mg_dir), MG_OUT=str(resharded), TP="2", PP="2",
               NUM_LAYER_LIST="1,3")
    assert len(list(resharded.glob("release/mp_rank_*"))) == 4
    run_recipe(RECIPES / "tiny_qwen" / "mcore2hf.sh", MG_DIR=str(resharded), HF_OUT=str(out), TOKENIZER="")

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        for shard in sorted(folder.glob("*.safetensors")):
            found.update(load_file(shard))
        return found

    before, after = tensors(source), tensors(out)
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
