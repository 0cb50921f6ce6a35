"""Mixture-of-experts checkpoints: bit-exact hf -> mg -> hf at EP x TP x PP, Megatron-LM's expert-parallel rank
folders, and mg -> mg to another EP / TP / PP equal to going through HF."""

import itertools
from pathlib import Path

import pytest
import torch

from mindrl.checkpoint import megatron as mg
from mindrl.ckpt_convert import hf_to_mcore, mcore_to_hf, mcore_to_mcore
from mindrl.ckpt_convert.cli import main as cli_main
from tests.hf_models import build_hf_model, save_hf_model
from tests.test_convert import read_hf

LAYOUTS = list(itertools.product((1, 2), (1, 2), (1, 2)))  # EP, TP, PP


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_hf")
    return {(kind, dtype): save_hf_model(build_hf_model(kind, seed=5, num_hidden_layers=2), root / f"{kind}_{dtype}",
                                         dtype=dtype)
            for kind in ("qwen3_moe", "qwen2_moe") for dtype in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("ep, tp, pp", LAYOUTS)
@pytest.mark.parametrize("kind, dtype", [("qwen3_moe", torch.float32), ("qwen2_moe", torch.bfloat16)])
def test_hf_to_mcore_to_hf_is_bit_exact(tmp_path, hf_dirs, kind, dtype, ep, tp, pp):
    hf_dir = hf_dirs[(kind, dtype)]
    hf_to_mcore(hf_dir, tmp_path / "mg", kind, tp, pp, params_dtype=dtype, progress=False, ep=ep)
    mcore_to_hf(tmp_path / "mg", tmp_path / "back", max_shard_size="200KB", progress=False)
    original, back = read_hf(hf_dir), read_hf(tmp_path / "back")
    assert sorted(back) == sorted(original)
    assert any(".mlp.experts.7.down_proj" in name for name in original)
    for name, tensor in original.items():
        assert back[name].dtype == dtype and torch.equal(back[name], tensor), name


def test_expert_parallel_rank_folders_are_megatron_lms(tmp_path, hf_dirs):
    out = hf_to_mcore(hf_dirs[("qwen3_moe", torch.float32)], tmp_path / "mg", "qwen3_moe", 2, 2,
                      params_dtype=torch.float32, progress=False, ep=2)
    folders = sorted(p.parent.name for p in out.rglob("model_optim_rng.pt"))
    assert folders == [f"mp_rank_0{t}_00{p}_00{e}" for t in (0, 1) for p in (0, 1) for e in (0, 1)]
    first = mg.load_rank(out, 1, 0, ep_rank=1)
    experts = sorted({n.split(".")[6] for n in first["model"] if ".local_experts." in n})
    assert experts == ["0", "1", "2", "3"]  # 8 experts over EP=2, numbered from 0 on each rank
    assert first["model"]["decoder.layers.0.mlp.router.weight"].shape == (8, 64)
    assert first["model"]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"].shape == (32, 64)
    assert first["args"].expert_model_parallel_size == 2 and first["args"].num_experts == 8
    other = mg.load_rank(out, 1, 0, ep_rank=0)
    name = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    assert not torch.equal(first["model"][name], other["model"][name])  # experts 4 and 0
    assert torch.equal(first["model"]["embedding.word_embeddings.weight"],
                       other["model"]["embedding.word_embeddings.weight"])


def _rank_files(root: Path) -> dict[str, dict]:
    return {str(p.relative_to(root)): torch.load(p, weights_only=True)
            for p in sorted(root.rglob("model_optim_rng.pt"))}


@pytest.mark.parametrize("source, target", [((2, 2, 2), (1, 1, 1)), ((1, 1, 2), (2, 2, 1)), ((2, 1, 1), (2, 2, 2))])
def test_mg_to_mg_to_another_expert_layout_equals_going_through_hf(tmp_path, hf_dirs, source, target):
    (ep, tp, pp), (ep2, tp2, pp2) = source, target
    hf_dir = hf_dirs[("qwen2_moe", torch.float32)]
    src = hf_to_mcore(hf_dir, tmp_path / "mg", "qwen2_moe", tp, pp, params_dtype=torch.float32, progress=False, ep=ep)
    direct = mcore_to_mcore(src, tmp_path / "direct", tp2, pp2, progress=False, ep=ep2)
    via_hf = hf_to_mcore(hf_dir, tmp_path / "via_hf", "qwen2_moe", tp2, pp2, params_dtype=torch.float32,
                         progress=False, ep=ep2)
    a, b = _rank_files(direct), _rank_files(via_hf)
    assert a.keys() == b.keys()
    for path in b:
        assert a[path]["model"].keys() == b[path]["model"].keys(), path
        for name, tensor in b[path]["model"].items():
            assert torch.equal(a[path]["model"][name], tensor), f"{path}: {name}"


def test_cli_takes_megatron_lms_expert_flag_and_refuses_what_cannot_be_cut(tmp_path, hf_dirs, capsys):
    hf_dir = str(hf_dirs[("qwen3_moe", torch.float32)])
    base = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf_dir, "--model-type-hf",
            "qwen3_moe", "--no-progress"]
    assert cli_main([*base, "--save-dir", str(tmp_path / "ok"), "--target-expert-parallel-size", "4"]) == 0
    assert len(list((tmp_path / "ok").rglob("model_optim_rng.pt"))) == 4
    assert cli_main([*base, "--save-dir", str(tmp_path / "bad"), "--target-expert-parallel-size", "3"]) == 2
    assert "expert_model_parallel_size=3 does not divide num_experts=8" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    dense = [*base[:-2], "qwen3", "--no-progress", "--save-dir", str(tmp_path / "fam")]
    assert cli_main(dense) == 2
    assert "model_type 'qwen3_moe'" in capsys.readouterr().err


def _converted_logits(rank: int, root: str, tokens: torch.Tensor):
    from megatron.core import parallel_state

    from mindrl.distributed import init_model_parallel
    from mindrl.models.forward import gather_logits, run_microbatches
    from mindrl.models.gpt import build_gpt_model, load_stage_weights

    args = mg.load_args(root)
    arch, par = mg.arch_of(args), mg.parallel_of(args)
    init_model_parallel(par, arch=arch)
    model = build_gpt_model(arch, par)
    ranks = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
    load_stage_weights(model, mg.load_rank(root, *ranks, arch, par,
                                           ep_rank=parallel_state.get_expert_model_parallel_rank())["model"])
    captured = []

    def keep(logits, batch):
        captured.append(gather_logits(logits).detach().clone())
        return logits.sum() * 0, {}

    run_microbatches(model, [{"tokens": tokens}], keep, forward_only=True)
    return captured[0] if captured else None


def test_a_converted_expert_parallel_checkpoint_loads_into_the_model_it_describes(tmp_path, hf_dirs):
    """The rank folders' names and expert numbering are the ones the EP=2 x TP=2 model's ranks ask for."""
    from mindrl.launch import run_ranks

    hf = build_hf_model("qwen3_moe", seed=5, num_hidden_layers=2)
    tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens).logits
    root = hf_to_mcore(hf_dirs[("qwen3_moe", torch.float32)], tmp_path / "mg", "qwen3_moe", 2, 1,
                       params_dtype=torch.float32, progress=False, ep=2)
    for logits in run_ranks(_converted_logits, 4, str(root), tokens):
        assert (logits - expected).abs().max().item() <= 1e-5
