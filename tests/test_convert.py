"""hf2mcore / mcore2hf: bit-exact round trips, the on-disk layout, and one sentence per mistake."""

import functools
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mindrl.checkpoint import megatron as mg
from mindrl.ckpt_convert import hf_to_mcore, mcore_to_hf, mcore_to_mcore, recut
from mindrl.ckpt_convert.cli import main as cli_main
from mindrl.ckpt_convert.safetensors_io import HFWeights
from mindrl.config import ConfigError, ParallelConfig
from mindrl.models import sharding, tp_layout
from mindrl.models.hf_mapping import arch_from_hf_config
from tests.hf_models import build_hf_model, save_hf_model

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
                                          r"\(QKV biases: a Qwen2-family model takes --model-type-hf qwen2\)"):
        hf_to_mcore(qwen_dir, tmp_path / "mg", "llama3", progress=False)
    # HF Llama has no QKV-only bias: such weights would not load back into transformers.
    with pytest.raises(ConfigError, match=r"^--add-qkv-bias does not fit --model-type-hf llama3: HF llama models "
                                          r"have no QKV-only bias"):
        hf_to_mcore(qwen_dir, tmp_path / "mg", "llama3", add_qkv_bias=True, progress=False)
    assert not (tmp_path / "mg").exists()


def _replace_hf_tensor(folder: Path, name: str, tensor: torch.Tensor) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][name]
    save_file({**load_file(shard), name: tensor}, shard, metadata={"format": "pt"})


@pytest.mark.parametrize("name, rows", [
    ("model.layers.1.input_layernorm.weight", 32),  # fewer bytes than the config's shape would read
    ("model.embed_tokens.weight", -1),
    ("model.embed_tokens.weight", +1),  # a row more than config.json's vocab_size would be dropped
    ("model.layers.0.mlp.gate_proj.weight", +32),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tensor_shaped_unlike_config_json_is_refused_before_writing(tmp_path, qwen_dir, name, rows, dtype):
    """Each rank tensor is cut by the shape config.json gives; a stored tensor of another shape would be
    read past its end (into its neighbour's bytes) or cut short, whether mapped as is or converted."""
    original = read_hf(qwen_dir)[name]
    size = rows if original.dim() == 1 else original.shape[0] + rows
    _replace_hf_tensor(qwen_dir, name, torch.ones(size, *original.shape[1:]))
    with pytest.raises(ConfigError, match=rf"^the HF checkpoint's {name} has shape \[{size}"
                                          rf"(, \d+)?\] but config.json gives \[{original.shape[0]}"):
        hf_to_mcore(qwen_dir, tmp_path / "mg", "qwen2", 1, 2, params_dtype=dtype, progress=False)
    assert not (tmp_path / "mg").exists()


@pytest.mark.parametrize("sliding", [
    {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1, "layer_types": None},
    {"layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
     "sliding_window": 8},
])
def test_sliding_window_attention_is_refused(tmp_path, qwen_dir, sliding):
    """mindrl's models attend over the whole sequence in every layer: such a model would convert but
    compute other logits than HF's."""
    config = json.loads((qwen_dir / "config.json").read_text())
    (qwen_dir / "config.json").write_text(json.dumps({**config, **sliding}))
    with pytest.raises(ConfigError, match=r"uses sliding-window attention \(window \d+\) in [23] of its 4 layers"):
        hf_to_mcore(qwen_dir, tmp_path / "mg", "qwen2", progress=False)
    assert not (tmp_path / "mg").exists()


@pytest.mark.parametrize("target", ["load_dir", "its_parent"])
@pytest.mark.parametrize("direction", ["hf2mcore", "mcore2hf", "mcore2mcore"])
def test_overwrite_never_replaces_a_directory_holding_the_input(tmp_path, qwen_dir, direction, target):
    (tmp_path / "notes.txt").write_text("keep me")
    source = qwen_dir if direction == "hf2mcore" else hf_to_mcore(qwen_dir, tmp_path / "mg", "qwen2",
                                                                   progress=False)
    save = source if target == "load_dir" else tmp_path
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    convert = {"hf2mcore": lambda: hf_to_mcore(source, save, "qwen2", overwrite=True, progress=False),
               "mcore2hf": lambda: mcore_to_hf(source, save, overwrite=True, progress=False),
               "mcore2mcore": lambda: mcore_to_mcore(source, save, overwrite=True, progress=False)}[direction]
    with pytest.raises(FileExistsError, match=r"is or holds the input .*, which writing there would delete; "
                                              r"choose a save directory outside it\.$"):
        convert()
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


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


@pytest.mark.parametrize("direction", ["hf2mcore", "mcore2hf", "mcore2mcore"])
def test_a_failure_midway_leaves_no_partial_output(tmp_path, qwen_dir, monkeypatch, direction):
    """A disk error on the second pipeline stage: no target, no temporary left behind."""
    import mindrl.ckpt_convert.hf2mcore as hf2mcore_module
    import mindrl.ckpt_convert.mcore2hf as mcore2hf_module

    if direction != "hf2mcore":
        hf_to_mcore(qwen_dir, tmp_path / "mg", "qwen2", 1, 2, progress=False)
    before = sorted(p.name for p in tmp_path.iterdir())
    module = mcore2hf_module if direction == "mcore2hf" else hf2mcore_module
    real = module._write_stage if direction == "mcore2hf" else module.mg.save_rank
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    if direction == "hf2mcore":
        monkeypatch.setattr(module.mg, "save_rank", failing)
        run = functools.partial(hf_to_mcore, qwen_dir, tmp_path / "out", "qwen2", 1, 2, progress=False)
    elif direction == "mcore2mcore":
        monkeypatch.setattr(module.mg, "save_rank", failing)  # the module both directions save through
        run = functools.partial(mcore_to_mcore, tmp_path / "mg", tmp_path / "out", 2, 2, progress=False)
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
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HF_DIR": str(qwen_dir), "HF_OUT": str(tmp_path / "back"),
           "TP": "2", "PP": "2", "DTYPE": "fp32", "NUM_LAYER_LIST": "3,1", "TARGET_TP": "1", "TARGET_PP": "2",
           "TARGET_NUM_LAYER_LIST": "1,3"}
    for script, folders in (("hf2mcore", {"MG_DIR": "mg"}), ("mcore2mcore", {"MG_DIR": "mg", "MG_OUT": "mg2"}),
                            ("mcore2hf", {"MG_DIR": "mg2"})):
        out = subprocess.run(["bash", str(ROOT / "examples" / "ckpt" / f"ckpt_convert_qwen25_{script}.sh"),
                              "--no-progress"], env={**env, **{k: str(tmp_path / v) for k, v in folders.items()}},
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    assert mg.parallel_of(mg.load_args(tmp_path / "mg2")).num_layer_list == (1, 3)
    original, back = read_hf(qwen_dir), read_hf(tmp_path / "back")
    assert back.keys() == original.keys() and all(torch.equal(back[n], t) for n, t in original.items())


def _rank_path(root: Path, tp_rank: int, pp_rank: int, pp: int) -> Path:
    return mg.rank_file(root, mg.read_tracker(root), tp_rank, pp_rank, pp)


def test_a_tied_output_copy_that_drifted_is_refused_before_writing(tmp_path, qwen_dir, capsys):
    """With PP > 1 the last stage holds Megatron's copy of the tied embedding; converting must not
    silently drop a copy that no longer equals the embedding."""
    out = hf_to_mcore(qwen_dir, tmp_path / "mg", "qwen2", 2, 2, params_dtype=torch.float32, progress=False)
    mcore_to_hf(out, tmp_path / "ok", progress=False)  # intact: converts
    path = _rank_path(out, 1, 1, 2)
    state = torch.load(path, weights_only=True)
    state["model"]["output_layer.weight"][5, 3] += 0.25
    torch.save(state, path)
    drifted = (rf"^checkpoint {out}: the last pipeline stage's output_layer.weight \(Megatron's copy of the "
               r"tied embedding\) differs from embedding.word_embeddings.weight on TP rank 1 by up to 0.25, ")
    with pytest.raises(ConfigError, match=drifted):
        mcore_to_hf(out, tmp_path / "back", progress=False)
    with pytest.raises(ConfigError, match=drifted):
        mcore_to_mcore(out, tmp_path / "mg2", 1, 1, progress=False)
    assert cli_main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(out),
                     "--save-dir", str(tmp_path / "back"), "--no-progress"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mg", "ok"]


RESHARD_CASES = {
    # kind, source TP, PP, layers -> target TP, PP, layers, dtype
    "qwen2_tp2pp2_to_tp1pp2_uneven": ("qwen2", (2, 2, None), (1, 2, "3,1"), torch.float32),
    "llama3_pp2_uneven_to_tp2": ("llama3", (1, 2, "1,3"), (2, 1, None), torch.bfloat16),
    "qwen3_tp2_to_tp1pp4": ("qwen3", (2, 1, None), (1, 4, None), torch.float32),
    "llama3_tp2pp2_uneven_to_tp2": ("llama3", (2, 2, "1,3"), (2, 1, None), torch.bfloat16),  # the cut stays
}


@pytest.mark.parametrize("case", sorted(RESHARD_CASES))
def test_mg_to_mg_equals_going_through_hf(tmp_path, case):
    kind, (tp, pp, layers), (tp2, pp2, layers2), dtype = RESHARD_CASES[case]
    hf_dir = save_hf_model(build_hf_model(kind), tmp_path / "hf", dtype=dtype)
    source = hf_to_mcore(hf_dir, tmp_path / "mg", kind, tp, pp, layers, params_dtype=dtype, progress=False)
    direct = mcore_to_mcore(source, tmp_path / "direct", tp2, pp2, layers2, progress=False)
    mcore_to_hf(source, tmp_path / "via_hf", progress=False)
    via_hf = hf_to_mcore(tmp_path / "via_hf", tmp_path / "mg_via_hf", kind, tp2, pp2, layers2, params_dtype=dtype,
                         progress=False)
    files = sorted(p.relative_to(direct) for p in direct.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(via_hf) for p in via_hf.rglob("*") if p.is_file())
    for tp_rank in range(tp2):
        for pp_rank in range(pp2):
            a = torch.load(_rank_path(direct, tp_rank, pp_rank, pp2), weights_only=True)
            b = torch.load(_rank_path(via_hf, tp_rank, pp_rank, pp2), weights_only=True)
            assert a["model"].keys() == b["model"].keys()
            for name, tensor in b["model"].items():
                assert a["model"][name].dtype == dtype and torch.equal(a["model"][name], tensor), name
            args_a, args_b = vars(a["args"]), vars(b["args"])
            assert {k: v for k, v in args_a.items() if k not in ("mindrl_arch", "hf_config")} == {
                k: v for k, v in args_b.items() if k not in ("mindrl_arch", "hf_config")}
            assert {**args_a["mindrl_arch"], "name": ""} == {**args_b["mindrl_arch"], "name": ""}


@pytest.mark.parametrize("argv, message", [
    (["--load-model-type", "mg", "--save-model-type", "hf", "--params-dtype", "fp32"],
     "--params-dtype applies to hf -> mg only, not mg -> hf; remove it."),
    (["--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "qwen2", "--max-shard-size", "1GB"],
     "--max-shard-size applies to mg -> hf only, not hf -> mg; remove it."),
    (["--load-model-type", "mg", "--save-model-type", "mg", "--model-type", "BERT"],
     "--model-type BERT is not supported; mindrl converts GPT (decoder-only) models only."),
    (["--load-model-type", "hf", "--save-model-type", "hf"],
     "--load-model-type hf --save-model-type hf is not a conversion; use hf -> mg, mg -> hf or mg -> mg."),
    (["--load-model-type", "mg", "--save-model-type", "mg", "--target-tensor-parallel-size", "4"],
     "tensor_model_parallel_size=4 does not divide num_query_groups=2"),
    (["--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "qwen3"],
     "config.json has model_type 'qwen2' but --model-type-hf qwen3 expects 'qwen3'"),
    (["--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "qwen2",
      "--target-tensor-parallel-size", "0"], "--target-tensor-parallel-size must be a positive integer, got 0."),
    (["--load-model-type", "mg", "--save-model-type", "mg", "--target-pipeline-parallel-size", "0"],
     "--target-pipeline-parallel-size must be a positive integer, got 0."),
])
def test_cli_refuses_in_one_sentence(tmp_path, qwen_dir, capsys, argv, message):
    source = qwen_dir if "hf" in argv[1] else hf_to_mcore(qwen_dir, tmp_path / "mg", "qwen2", progress=False)
    assert cli_main([*argv, "--load-dir", str(source), "--save-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_tokenizer_model_travels_with_the_checkpoint(tmp_path, qwen_dir, capsys):
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    vocab = {f"t{i}": i for i in range(240)}
    (tokenizer / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab},
                                                          "added_tokens": [{"id": 250, "content": "<|x|>"}]}))
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"tag": "the new tokenizer"}))
    flags = ["--use-mcore-models", "--model-type", "GPT", "--no-progress"]
    assert cli_main(["--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "qwen2", "--load-dir",
                     str(qwen_dir), "--save-dir", str(tmp_path / "mg"), "--tokenizer-model",
                     str(tokenizer / "tokenizer.json"), *flags]) == 0
    assets = tmp_path / "mg" / "hf_assets"
    assert (assets / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    assert json.loads((assets / "tokenizer_config.json").read_text()) == {"tag": "the new tokenizer"}
    assert (assets / "generation_config.json").is_file()  # the source's other files are still there
    assert cli_main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(tmp_path / "mg"),
                     "--save-dir", str(tmp_path / "back"), *flags]) == 0
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()

    (tokenizer / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": [{"id": 299}]}))
    assert cli_main(["--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", str(tmp_path / "mg"),
                     "--save-dir", str(tmp_path / "mg2"), "--tokenizer-model", str(tokenizer), *flags]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer-model {tokenizer} has 300 tokens but the model's vocabulary has 251 rows" in err
    assert not (tmp_path / "mg2").exists()


@pytest.mark.parametrize("kind, tp_in, tp_out", [("qwen2", 1, 2), ("qwen2", 2, 1), ("llama3", 2, 4), ("llama3", 4, 2),
                                                 ("qwen3", 2, 2)])
def test_recut_fills_each_target_slice_as_joining_and_cutting_again_would(kind, tp_in, tp_out):
    arch = arch_from_hf_config(build_hf_model(kind).config.to_dict(), kind)
    source_par = ParallelConfig(tp_in, 1)
    for name, tensor in sharding.random_full_state_dict(arch, seed=1).items():
        slices = sharding.split_full_tensor(name, tensor, arch, source_par)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            for rank, piece in enumerate(slices):  # padding rows need not be zero in a Megatron checkpoint
                start, stop, _ = sharding.vocab_rows(arch, source_par, rank)
                piece[stop - start:] = 7.0
        expected = sharding.split_full_tensor(name, tensor, arch, ParallelConfig(tp_out, 1))
        target, source = tp_layout.rank_pieces(arch, tp_out, name), tp_layout.rank_pieces(arch, tp_in, name)
        for rank, want in enumerate(expected):
            got = recut.fill_rank_tensor(torch.full_like(want, torch.nan), target[rank], source, slices, tp_out, tp_in)
            assert torch.equal(got, want), f"{name} rank {rank}"


def test_mg_to_mg_writes_vocabulary_padding_as_zeros_where_the_cut_stays(tmp_path, qwen_dir):
    """Slices whose cut does not change are passed through, but padding rows are re-created as zeros,
    as the trip through HF would: a Megatron checkpoint's need not be zero."""
    source = hf_to_mcore(qwen_dir, tmp_path / "mg", "qwen2", 2, 1, params_dtype=torch.float32, progress=False)
    path = _rank_path(source, 1, 0, 1)
    state = torch.load(path, weights_only=True)
    embedding = state["model"]["embedding.word_embeddings.weight"]  # 251 rows padded to 2 × 126
    embedding[-1] = 3.0
    torch.save(state, path)
    out = mcore_to_mcore(source, tmp_path / "out", 2, 2, progress=False)
    for pp_rank, name in ((0, "embedding.word_embeddings.weight"), (1, "output_layer.weight")):
        tensor = torch.load(_rank_path(out, 1, pp_rank, 2), weights_only=True)["model"][name]
        assert torch.equal(tensor[:-1], embedding[:-1]) and not tensor[-1].any(), name


def test_hf_rows_are_read_mapped_and_own_only_their_bytes(qwen_dir):
    """A vocabulary slice is written straight from the mapped file, without dragging the whole table along."""
    rows = HFWeights(qwen_dir).get("model.embed_tokens.weight", rows=(5, 100))
    assert torch.equal(rows, read_hf(qwen_dir)["model.embed_tokens.weight"][5:100])
    assert rows.untyped_storage().nbytes() == rows.numel() * rows.element_size()


def test_a_header_that_does_not_match_its_bytes_is_caught_before_writing(tmp_path, qwen_dir):
    index = json.loads((qwen_dir / "model.safetensors.index.json").read_text())
    shard = qwen_dir / index["weight_map"]["model.norm.weight"]
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header["model.norm.weight"]["shape"] = [32]
    text = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])
    with pytest.raises(OSError, match=r"model.norm.weight has shape \[32\] in F32 but 256 bytes; the file is damaged"):
        hf_to_mcore(qwen_dir, tmp_path / "mg", "qwen2", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_mg_to_hf_keeps_only_the_rows_of_the_hf_configs_vocabulary(tmp_path, qwen_dir):
    """An HF config may name fewer vocabulary rows than the checkpoint holds; the rest are left out,
    here from the middle of the last TP rank's slice."""
    source = hf_to_mcore(qwen_dir, tmp_path / "mg", "qwen2", 2, 1, params_dtype=torch.float32, progress=False)
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    config = json.loads((qwen_dir / "config.json").read_text())
    (config_dir / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    mcore_to_hf(source, tmp_path / "back", hf_config_dir=config_dir, progress=False)
    embedding = read_hf(tmp_path / "back")["model.embed_tokens.weight"]
    assert torch.equal(embedding, read_hf(qwen_dir)["model.embed_tokens.weight"][:200])
