"""Mixture-of-experts checkpoints: bit-exact hf -> mg -> hf at EP x TP x PP, Megatron-LM's expert-parallel rank
folders, and mg -> mg to another EP / TP / PP equal to going through HF."""

import itertools
from pathlib import Path

import pytest
import torch

from mindrl.checkpoint import megatron as mg
from mindrl.ckpt_convert import hf_to_mcore, mcore_to_hf, mcore_to_mcore
from mindrl.ckpt_convert.cli import main as cli_main
from mindrl.config import ConfigError
from tests.hf_models import build_hf_model, save_hf_model
from tests.test_convert import read_hf

LAYOUTS = list(itertools.product((1, 2), (1, 2), (1, 2)))  # EP, TP, PP
#: the families with DeepSeek-style routing (dense layers first, the expert bias, MTP layers)
DEEPSEEK = ("glm4_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_hf")
    return {(kind, dtype): save_hf_model(build_hf_model(kind, seed=5, num_hidden_layers=4 if kind in DEEPSEEK else 2),
                                         root / f"{kind}_{dtype}", dtype=dtype)
            for kind in ("qwen3_moe", "qwen2_moe", *DEEPSEEK) for dtype in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("ep, tp, pp", LAYOUTS)
@pytest.mark.parametrize("kind, dtype", [("qwen3_moe", torch.float32), ("qwen2_moe", torch.bfloat16),
                                         ("glm4_moe", torch.bfloat16), ("deepseek_v3", torch.bfloat16)])
def test_hf_to_mcore_to_hf_is_bit_exact(tmp_path, hf_dirs, kind, dtype, ep, tp, pp):
    hf_dir = hf_dirs[(kind, dtype)]
    hf_to_mcore(hf_dir, tmp_path / "mg", kind, tp, pp, params_dtype=dtype, progress=False, ep=ep)
    mcore_to_hf(tmp_path / "mg", tmp_path / "back", max_shard_size="200KB", progress=False)
    original, back = read_hf(hf_dir), read_hf(tmp_path / "back")
    assert sorted(back) == sorted(original)
    assert any(".mlp.experts.7.down_proj" in name for name in original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    # GLM-4.5's and DeepSeek-V3's expert bias stays fp32 in a bf16 checkpoint, through Megatron's files too
    assert {t.dtype for t in original.values()} == ({dtype, torch.float32} if kind in DEEPSEEK else {dtype})


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


@pytest.mark.parametrize("kind, dtype, source, target", [
    ("qwen2_moe", torch.float32, (2, 2, 2), (1, 1, 1)), ("qwen2_moe", torch.float32, (1, 1, 2), (2, 2, 1)),
    ("qwen2_moe", torch.float32, (2, 1, 1), (2, 2, 2)), ("glm4_moe", torch.bfloat16, (2, 2, 2), (1, 2, 1)),
    ("glm4_moe", torch.bfloat16, (1, 1, 2), (2, 1, 4)), ("deepseek_v3", torch.bfloat16, (2, 2, 2), (1, 1, 4))])
def test_mg_to_mg_to_another_expert_layout_equals_going_through_hf(tmp_path, hf_dirs, kind, dtype, source, target):
    (ep, tp, pp), (ep2, tp2, pp2) = source, target
    hf_dir = hf_dirs[(kind, dtype)]
    src = hf_to_mcore(hf_dir, tmp_path / "mg", kind, tp, pp, params_dtype=dtype, progress=False, ep=ep)
    direct = mcore_to_mcore(src, tmp_path / "direct", tp2, pp2, progress=False, ep=ep2)
    via_hf = hf_to_mcore(hf_dir, tmp_path / "via_hf", kind, tp2, pp2, params_dtype=dtype, progress=False, ep=ep2)
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


def _grouped_copies(rank: int, src: str, legacy: str, te: str) -> None:
    """Rewrite every rank file of `src` into the two grouped-GEMM layouts Megatron writes with
    --moe-grouped-gemm: the legacy GroupedMLP's weight1/weight2, built by megatron-core's own merge function
    (the one its distributed checkpoints load GroupedMLP with), and Transformer Engine's `weight<i>` names."""
    import re

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import experts, grouped_gemm_util

    parallel_state.initialize_model_parallel()
    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None  # only its state-dict code runs here
    expert_name = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$")
    for path in sorted(Path(src).rglob("model_optim_rng.pt")):
        state = torch.load(path, weights_only=True)
        args = state["args"]
        local = args.num_experts // args.expert_model_parallel_size
        config = TransformerConfig(num_layers=1, hidden_size=args.hidden_size, num_attention_heads=1,
                                   num_moe_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                                   gated_linear_unit=True, add_bias_linear=False, use_cpu_initialization=True)
        merge = {name: factory.merge_fn for name, factory in experts.GroupedMLP(
            local, config, ProcessGroupCollection.use_mpu_process_groups()).sharded_state_dict().items()
            if name in ("weight1", "weight2")}
        per_layer, te_model, legacy_model = {}, {}, {}
        for name, tensor in state["model"].items():
            match = expert_name.match(name)
            if match is None:
                te_model[name] = legacy_model[name] = tensor
                continue
            prefix, expert, linear = match.groups()
            te_model[f"{prefix}{linear}.weight{expert}"] = tensor
            per_layer.setdefault((prefix, linear), {})[int(expert)] = tensor
        for (prefix, linear), tensors in per_layer.items():
            stacked = torch.stack([tensors[e] for e in range(local)])
            if linear == "linear_fc1":  # the merge function takes the gate and up halves apart
                legacy_model[prefix + "weight1"] = merge["weight1"](list(stacked.chunk(2, dim=-2)))
            else:
                legacy_model[prefix + "weight2"] = merge["weight2"](stacked)
        del args.mindrl_arch  # read as a Megatron-LM / MindSpeed-LLM checkpoint, from Megatron's names
        args.moe_grouped_gemm = True
        for root, model in ((legacy, legacy_model), (te, te_model)):
            out = Path(root) / path.relative_to(src)
            out.parent.mkdir(parents=True, exist_ok=True)
            torch.save({**state, "model": model, "args": args}, out)
    for root in (legacy, te):
        (Path(root) / "latest_checkpointed_iteration.txt").write_text(
            (Path(src) / "latest_checkpointed_iteration.txt").read_text())


def test_grouped_gemm_expert_checkpoints_convert_to_the_original_hf_weights(tmp_path, hf_dirs):
    """Megatron-LM / MindSpeed-LLM checkpoints trained with --moe-grouped-gemm (both of megatron-core's grouped
    layouts) read back to the HF weights bit for bit, and re-shard to the layout hf -> mg writes."""
    from mindrl.launch import run_ranks

    hf_dir = hf_dirs[("qwen3_moe", torch.float32)]
    src = hf_to_mcore(hf_dir, tmp_path / "mg", "qwen3_moe", 2, 2, params_dtype=torch.float32, progress=False, ep=2)
    legacy, te = tmp_path / "legacy", tmp_path / "te"
    run_ranks(_grouped_copies, 1, str(src), str(legacy), str(te))
    first = torch.load(next(legacy.rglob("model_optim_rng.pt")), weights_only=True)["model"]
    assert first["decoder.layers.0.mlp.experts.weight1"].shape == (64, 4 * 32)  # 4 local experts, gate+up / TP
    assert not any(".local_experts." in name for name in first)
    original = read_hf(hf_dir)
    for root in (legacy, te):
        back = read_hf(mcore_to_hf(root, tmp_path / f"{root.name}_hf", progress=False))
        assert back.keys() == original.keys()
        for name, tensor in original.items():
            assert torch.equal(back[name], tensor), f"{root.name}: {name}"
    direct = _rank_files(mcore_to_mcore(legacy, tmp_path / "resharded", 1, 1, progress=False, ep=1))
    via_hf = _rank_files(hf_to_mcore(hf_dir, tmp_path / "via_hf", "qwen3_moe", 1, 1, params_dtype=torch.float32,
                                     progress=False))
    for path, state in via_hf.items():
        for name, tensor in state["model"].items():
            assert torch.equal(direct[path]["model"][name], tensor), f"{path}: {name}"


def test_grouped_expert_weights_that_cannot_be_split_are_one_sentence():
    from mindrl.checkpoint import chunks
    from mindrl.config import ConfigError

    weights = {"decoder.layers.0.mlp.experts.weight2": torch.zeros(30, 64)}
    with pytest.raises(ConfigError, match=r"weight2 has shape \(30, 64\), which does not split into 4 experts"):
        chunks.normalize_model(weights, "rank file", local_experts=4)
    with pytest.raises(ConfigError, match=r"the checkpoint's args do not name num_experts"):
        chunks.normalize_model(weights, "rank file")


def _with_mtp_layer(hf_dir: Path, out: Path) -> Path:
    """`hf_dir` plus the multi-token-prediction layer a published GLM-4.5 checkpoint stores after its decoder layers
    (transformers' own save leaves it out): a copy of the last layer's tensors under the next index, and the MTP
    projection and norms."""
    import json
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(hf_dir, out)
    state = read_hf(hf_dir)
    layers = json.loads((hf_dir / "config.json").read_text())["num_hidden_layers"]
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    gen = torch.Generator().manual_seed(11)
    extra = {mtp + name.removeprefix(last): torch.randn(t.shape, generator=gen).to(t.dtype)
             for name, t in state.items() if name.startswith(last)}
    hidden = state["model.norm.weight"].shape[0]
    extra.update({mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen).to(torch.bfloat16),
                  **{mtp + norm: torch.randn(hidden, generator=gen).to(torch.bfloat16)
                     for norm in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}})
    save_file(extra, out / "model-mtp.safetensors", metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(extra, "model-mtp.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return out


@pytest.mark.parametrize("kind", DEEPSEEK)
def test_an_mtp_layer_is_carried_through_conversion_untrained(tmp_path, hf_dirs, kind):
    """hf -> mg -> mg (another layout) -> hf gives back every tensor, the MTP layer's too; an export without it (a
    trained checkpoint's, which does not hold it) says so in its config; a layer past the MTP ones is refused."""
    import json

    hf_dir = _with_mtp_layer(hf_dirs[(kind, torch.bfloat16)], tmp_path / "hf")
    src = hf_to_mcore(hf_dir, tmp_path / "mg", kind, 2, 2, params_dtype=torch.bfloat16, progress=False, ep=2)
    moved = mcore_to_mcore(src, tmp_path / "mg2", 1, 4, progress=False, ep=1)
    mcore_to_hf(moved, tmp_path / "back", progress=False)
    original, back = read_hf(hf_dir), read_hf(tmp_path / "back")
    assert sorted(back) == sorted(original) and any(".layers.4.eh_proj" in name for name in back)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1

    (src / "hf_assets" / "mtp_layers.safetensors").unlink()
    mcore_to_hf(src, tmp_path / "without", progress=False)
    assert not any(".layers.4." in name for name in read_hf(tmp_path / "without"))
    assert json.loads((tmp_path / "without" / "config.json").read_text())["num_nextn_predict_layers"] == 0

    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ConfigError, match=r"tensors the architecture does not use, e.g. model.layers.4."):
        hf_to_mcore(hf_dir, tmp_path / "refused", kind, params_dtype=torch.bfloat16, progress=False)
