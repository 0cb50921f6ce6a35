"""hf2mcore / mcore2hf: bit-exact round trips, the on-disk layout, and one sentence per mistake."""

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mindrl.checkpoint import megatron as mg
from mindrl.config import ConfigError, ParallelConfig
from tests.hf_models import build_hf_model, save_hf_model
from mindrl.ckpt_convert import hf_to_mcore, mcore_to_hf

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    # (a) Qwen2, QKV bias, tied embeddings; (c) GQA with 2 query groups at TP=2
    "qwen2_tp2pp2_fp32": ("qwen2", 2, 2, None, torch.float32),
    "qwen2_tp2_bf16": ("qwen2", 2, 1, None, torch.bfloat16),
    # (b) Llama, no bias, untied; (d) uneven PP
    "llama3_pp2_uneven_fp32": ("llama3", 1, 2, "3,1", torch.float32),
    "llama3_tp2pp2_uneven_bf16": ("llama3", 2, 2, "1,3", torch.bfloat16),
    "qwen3_tp2_fp32": ("qwen3", 2, 1, None, torch.float32),
}


def read_hf(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_mcore_to_hf_is_bit_exact(tmp_path, case):
    kind, tp, pp, layers, dtype = CASES[case]
    hf_dir = save_hf_model(build_hf_model(kind), tmp_path / "hf", dtype=dtype)
    hf_to_mcore(hf_dir, tmp_path / "mg", kind, tp, pp, layers, params_dtype=dtype, progress=False)
    mcore_to_hf(tmp_path / "mg", tmp_path / "back", max_shard_size="100KB", progress=False)

    original, back = read_hf(hf_dir), read_hf(tmp_path / "back")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == dtype and torch.equal(back[name], tensor), name
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text())
    for asset in ("generation_config.json", "tokenizer_config.json"):
        assert (tmp_path / "back" / asset).read_bytes() == (hf_dir / asset).read_bytes()
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original) and len(set(index["weight_map"].values())) > 1


def test_megatron_layout_on_disk(tmp_path):
    hf_dir = save_hf_model(build_hf_model("qwen2"), tmp_path / "hf")
    out = hf_to_mcore(hf_dir, tmp_path / "mg", "qwen2", 2, 2, params_dtype=torch.float32, progress=False)
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    files = sorted(str(p.relative_to(out)) for p in out.rglob("model_optim_rng.pt"))
    assert files == [f"release/mp_rank_0{t}_00{p}/model_optim_rng.pt" for t in (0, 1) for p in (0, 1)]
    first = mg.load_rank(out, 0, 0)
    last = mg.load_rank(out, 1, 1)
    assert "embedding.word_embeddings.weight" in first["model"]
    assert "decoder.final_layernorm.weight" not in first["model"]
    assert {"decoder.final_layernorm.weight", "output_layer.weight"} <= set(last["model"])
    # vocab 251 padded to 252 for TP=2: 126 rows per rank
    assert first["model"]["embedding.word_embeddings.weight"].shape == (126, 64)
    assert last["args"].tensor_model_parallel_size == 2 and last["args"].num_query_groups == 2
    single = hf_to_mcore(hf_dir, tmp_path / "mg1", "qwen2", 1, 1, progress=False)
    assert [p.parent.name for p in single.rglob("model_optim_rng.pt")] == ["mp_rank_00"]


def test_loading_with_another_layout_or_architecture_is_one_sentence(tmp_path):
    hf_dir = save_hf_model(build_hf_model("qwen2"), tmp_path / "hf")
    out = hf_to_mcore(hf_dir, tmp_path / "mg", "qwen2", 2, 1, progress=False)
    arch = mg.arch_of(mg.load_args(out))
    with pytest.raises(ConfigError, match=r"sharded TP=2 PP=1 but the model is TP=1 PP=2; re-shard"):
        mg.load_rank(out, 0, 0, expect_par=ParallelConfig(1, 2))
    other = type(arch)(**{**arch.__dict__, "hidden_size": 128})
    with pytest.raises(ConfigError, match=r"different architecture .* hidden_size=64 \(model: 128\)"):
        mg.load_rank(out, 0, 0, expect_arch=other)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli" / "convert_ckpt.py"), *args],
                          capture_output=True, text=True)


def test_cli_round_trip_with_megatron_flag_names(tmp_path):
    hf_dir = save_hf_model(build_hf_model("llama3"), tmp_path / "hf")
    to_mg = run_cli("--load-model-type", "hf", "--save-model-type", "mg",
                    "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2",
                    "--num-layer-list", "1,3", "--load-dir", str(hf_dir), "--save-dir", str(tmp_path / "mg"),
                    "--model-type-hf", "llama3", "--params-dtype", "fp32")
    assert to_mg.returncode == 0, to_mg.stderr
    assert "hf2mcore" in to_mg.stderr  # per-layer progress bar
    to_hf = run_cli("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(tmp_path / "mg"),
                    "--save-dir", str(tmp_path / "back"), "--hf-config-dir", str(hf_dir))
    assert to_hf.returncode == 0, to_hf.stderr
    original, back = read_hf(hf_dir), read_hf(tmp_path / "back")
    assert all(torch.equal(back[n], t) for n, t in original.items()) and back.keys() == original.keys()


@pytest.fixture
def qwen_dir(tmp_path):
    return save_hf_model(build_hf_model("qwen2"), tmp_path / "hf")


@pytest.mark.parametrize("flags, message", [
    (["--target-tensor-parallel-size", "4"],
     "tensor_model_parallel_size=4 does not divide num_query_groups=2"),
    (["--target-pipeline-parallel-size", "2", "--num-layer-list", "1,2"], "sums to 3 but model"),
    (["--target-pipeline-parallel-size", "3"], "num_layers=4 of model hf is not divisible by"),
    (["--model-type-hf", "llama3"], "model_type 'qwen2' but --model-type-hf llama3 expects 'llama'"),
])
def test_bad_input_is_one_sentence_and_writes_nothing(tmp_path, qwen_dir, flags, message):
    args = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(qwen_dir),
            "--save-dir", str(tmp_path / "mg")]
    if "--model-type-hf" not in flags:
        args += ["--model-type-hf", "qwen2"]
    out = run_cli(*args, *flags)
    assert out.returncode == 2
    assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert not (tmp_path / "mg").exists()


def test_missing_files_and_tensors_are_named(tmp_path, qwen_dir):
    out = run_cli("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(tmp_path / "nope"),
                  "--save-dir", str(tmp_path / "mg"), "--model-type-hf", "qwen2")
    assert out.returncode == 2 and "has no config.json" in out.stderr
    index_path = qwen_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    gone = "model.layers.2.mlp.up_proj.weight"
    shard = qwen_dir / index["weight_map"].pop(gone)
    save_file({k: v for k, v in load_file(shard).items() if k != gone}, shard)
    index_path.write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"lacks 1 tensors the architecture needs, e.g. " + gone):
        hf_to_mcore(qwen_dir, tmp_path / "mg", "qwen2", progress=False)
    assert not (tmp_path / "mg").exists()


def test_unexpected_tensors_are_not_dropped_silently(tmp_path, qwen_dir):
    config = json.loads((qwen_dir / "config.json").read_text())
    (qwen_dir / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ConfigError, match=r"does not use, e.g. model.layers.0.self_attn.k_proj.bias "
                                          r"\(pass --add-qkv-bias\)"):
        hf_to_mcore(qwen_dir, tmp_path / "mg", "llama3", progress=False)
    hf_to_mcore(qwen_dir, tmp_path / "mg", "llama3", add_qkv_bias=True, progress=False)
    assert mg.arch_of(mg.load_args(tmp_path / "mg")).add_qkv_bias


def test_refuses_a_non_empty_target_and_overwrites_only_when_told(tmp_path, qwen_dir):
    target = tmp_path / "mg"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty; choose an empty save directory or pass"):
        hf_to_mcore(qwen_dir, target, "qwen2", progress=False)
    assert (target / "precious.txt").read_text() == "keep me"
    hf_to_mcore(qwen_dir, target, "qwen2", overwrite=True, progress=False)
    assert not (target / "precious.txt").exists() and (target / "latest_checkpointed_iteration.txt").exists()


def test_a_truncated_shard_is_caught_before_writing(tmp_path, qwen_dir):
    index = json.loads((qwen_dir / "model.safetensors.index.json").read_text())
    last_shard = qwen_dir / index["weight_map"]["model.norm.weight"]
    data = last_shard.read_bytes()
    last_shard.write_bytes(data[: len(data) - 64])
    with pytest.raises(OSError, match="is truncated: its header promises"):
        hf_to_mcore(qwen_dir, tmp_path / "mg", "qwen2", 1, 2, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


@pytest.mark.parametrize("direction", ["hf2mcore", "mcore2hf"])
def test_a_failure_midway_leaves_no_partial_output(tmp_path, qwen_dir, monkeypatch, direction):
    """A disk error on the second pipeline stage: no target, no temporary left behind."""
    import mindrl.ckpt_convert.hf2mcore as hf2mcore_module
    import mindrl.ckpt_convert.mcore2hf as mcore2hf_module

    if direction == "mcore2hf":
        hf_to_mcore(qwen_dir, tmp_path / "mg", "qwen2", 1, 2, progress=False)
    before = sorted(p.name for p in tmp_path.iterdir())
    module = hf2mcore_module if direction == "hf2mcore" else mcore2hf_module
    real = module.mg.save_rank if direction == "hf2mcore" else module._write_stage
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    if direction == "hf2mcore":
        monkeypatch.setattr(module.mg, "save_rank", failing)
        run = functools.partial(hf_to_mcore, qwen_dir, tmp_path / "out", "qwen2", 1, 2, progress=False)
    else:
        monkeypatch.setattr(module, "_write_stage", failing)
        run = functools.partial(mcore_to_hf, tmp_path / "mg", tmp_path / "out", progress=False)
    with pytest.raises(OSError, match="No space left"):
        run()
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("kind", ["qwen2", "llama3", "qwen3"])
def test_hf_param_shapes_match_transformers(kind):
    from mindrl.models.hf_mapping import arch_from_hf_config, hf_param_shapes

    model = build_hf_model(kind)
    arch = arch_from_hf_config(model.config.to_dict(), kind)
    actual = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if arch.tied_embeddings:
        actual.pop("lm_head.weight")
    assert hf_param_shapes(arch) == actual


def test_converter_does_not_import_megatron():
    code = "import mindrl.ckpt_convert.cli, mindrl.ckpt_convert, sys; print('megatron' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_rank_files_hold_only_their_own_bytes(tmp_path):
    """A TP slice is a view of a bigger tensor; saved as is it would drag the whole tensor along."""
    hf_dir = save_hf_model(build_hf_model("llama3"), tmp_path / "hf")
    out = hf_to_mcore(hf_dir, tmp_path / "mg", "llama3", 2, 2, params_dtype=torch.float32, progress=False)
    for path in out.rglob("model_optim_rng.pt"):
        tensors = torch.load(path, weights_only=True)["model"].values()
        payload = sum(t.numel() * t.element_size() for t in tensors)
        assert path.stat().st_size < payload + 64 * 1024, path


def test_example_scripts_round_trip(tmp_path, qwen_dir):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HF_DIR": str(qwen_dir),
           "MG_DIR": str(tmp_path / "mg"), "HF_OUT": str(tmp_path / "back"), "TP": "2", "PP": "2",
           "DTYPE": "fp32", "NUM_LAYER_LIST": "3,1"}
    for script in ("ckpt_convert_qwen25_hf2mcore.sh", "ckpt_convert_qwen25_mcore2hf.sh"):
        out = subprocess.run(["bash", str(ROOT / "examples" / "ckpt" / script), "--no-progress"],
                             env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    original, back = read_hf(qwen_dir), read_hf(tmp_path / "back")
    assert back.keys() == original.keys() and all(torch.equal(back[n], t) for n, t in original.items())
