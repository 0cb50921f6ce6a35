"""A LoRA actor's checkpoints out to HF (issue 47): the merged export and the base HF model under PEFT's adapter
folder both score as the actor does; an adapters-only checkpoint merges into the base it records or is given,
and a wrong or missing base is one sentence before anything is written."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mindrl.checkpoint import megatron as mg
from mindrl.ckpt_convert import cli
from mindrl.ckpt_convert.mcore2hf import mcore_to_hf
from mindrl.ckpt_convert.mcore2mcore import mcore_to_mcore
from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker
from tests.test_lora import LORA, _adapter_values, _set_adapters

PAR = ParallelConfig(2, 1)
ROWS, SEQ = 4, 12


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(3))


def _write_base(root: Path, full: dict, arch) -> str:
    """A converted (release) Megatron checkpoint of `full` at the actor's layout, as hf -> mg writes one."""
    args = mg.checkpoint_args(arch, PAR, torch.float32)
    for tp_rank in range(PAR.tp):
        mg.save_rank(root, "release", tp_rank, 0, sharding.shard_state_dict(full, arch, PAR, tp_rank, 0), args)
    mg.write_tracker(root, "release")
    return str(root)


def _save(rank: int, root: Path, full: dict, adapters: dict, base: str) -> torch.Tensor | None:
    """The LoRA actor (TP=2, known non-zero A and B) saves full, adapters-only, and adapters-only with no recorded
    base; returns its log-probs."""
    arch = load_model_arch("tiny_qwen")
    cfg = ActorConfig(lr=1e-2, mini_batch_size=ROWS, micro_batch_size=2, prompt_packing="off", lora=LORA)
    actor = ActorWorker(arch, PAR, cfg, weights=full)
    _set_adapters(actor, adapters)
    actor.save_checkpoint(root / "full", 1, {"initial_weights": base})
    actor.cfg = replace(cfg, lora=replace(LORA, ckpt_filter=True))
    actor.save_checkpoint(root / "adapters", 1, {"initial_weights": base})
    actor.save_checkpoint(root / "orphan", 1, {"initial_weights": None})
    tokens = _tokens(arch.padded_vocab_size)
    out = actor.compute_log_prob({"tokens": tokens, "loss_mask": torch.ones(ROWS, SEQ)})
    return out["log_probs"][:, :SEQ - 1] if out is not None else None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_export")
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=6)
    base = _write_base(root / "base", full, arch)
    _write_base(root / "other_base", sharding.random_full_state_dict(arch, seed=7), arch)
    log_probs = run_ranks(_save, 2, root, full, _adapter_values(arch), base)[0]
    mcore_to_hf(base, root / "base_hf", progress=False)
    return root, arch, log_probs


def _hf_log_probs(model: torch.nn.Module, arch) -> torch.Tensor:
    tokens = _tokens(arch.padded_vocab_size)
    with torch.no_grad():
        logits = model(tokens).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return {name: t for file in sorted(path.glob("*.safetensors")) for name, t in load_file(file).items()}


def _load(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_merged_export_scores_as_the_actor(saved):
    root, arch, actor = saved
    mcore_to_hf(root / "full", root / "merged", progress=False)
    diff = (_hf_log_probs(_load(root / "merged"), arch) - actor).abs().max().item()
    assert diff <= 1e-5
    base = (_hf_log_probs(_load(root / "base_hf"), arch) - actor).abs().max().item()
    assert base > 1e-3  # the adapters change the model: the merge is not a no-op


def test_base_with_peft_adapter_folder_scores_as_the_actor(saved, capsys):
    peft = pytest.importorskip("peft")
    root, arch, actor = saved
    assert cli.main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(root / "full"),
                     "--save-dir", str(root / "merged_cli"), "--save-lora-adapter", str(root / "adapter"),
                     "--no-progress"]) == 0
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == \
        ("LORA", "CAUSAL_LM", LORA.r, LORA.alpha)
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    keys = load_file(root / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 2 * 7 * arch.num_layers
    model = peft.PeftModel.from_pretrained(_load(root / "base_hf"), root / "adapter").eval()
    diff = (_hf_log_probs(model, arch) - actor).abs().max().item()
    assert diff <= 1e-5


def test_adapters_only_merges_into_its_recorded_or_given_base(saved):
    root, _, _ = saved
    merged = mcore_to_hf(root / "full", root / "merged_ref", progress=False)
    recorded = mcore_to_hf(root / "adapters", root / "from_recorded", progress=False)
    given = mcore_to_hf(root / "orphan", root / "from_given", progress=False, lora_base=root / "base")
    expected = _weights(merged)
    for out in (recorded, given):
        got = _weights(out)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[name], expected[name]) for name in expected)  # the same merge, bit for bit


def test_a_wrong_base_is_refused_before_writing(saved, capsys):
    root, _, _ = saved
    with pytest.raises(ConfigError, match=r"is not the one the adapters of .* were trained on"):
        mcore_to_hf(root / "adapters", root / "wrong", progress=False, lora_base=root / "other_base")
    assert not (root / "wrong").exists()
    assert cli.main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(root / "adapters"),
                     "--save-dir", str(root / "wrong_cli"), "--lora-base", str(root / "other_base")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: the LoRA base") and err.endswith("--lora-base.")
    assert not (root / "wrong_cli").exists()


def test_no_base_anywhere_is_one_sentence(saved):
    root, _, _ = saved
    with pytest.raises(ConfigError, match=r"records no base .* pass --lora-base"):
        mcore_to_hf(root / "orphan", root / "orphan_hf", progress=False)
    assert not (root / "orphan_hf").exists()


@pytest.mark.parametrize("call, message", [
    (lambda root: mcore_to_hf(root / "full", root / "x1", progress=False, lora_base=root / "base"),
     "holds its base weights itself; remove --lora-base"),
    (lambda root: mcore_to_hf(root / "base", root / "x2", progress=False, lora_adapter_dir=root / "x2a"),
     "needs a LoRA checkpoint"),
    (lambda root: mcore_to_mcore(root / "full", root / "x3", 1, 1, progress=False), "does not re-shard"),
])
def test_lora_flags_out_of_place_are_one_sentence(saved, call, message):
    root, _, _ = saved
    with pytest.raises(ConfigError, match=message):
        call(root)


def test_a_lora_runs_final_export_writes_merged_weights_and_the_adapter_folder(saved):
    from mindrl.trainer.export import ADAPTER_DIR, export_hf

    root, arch, actor = saved
    target = export_hf(root / "adapters", None)  # as SFT / DPO end: adapters-only, base from initial_weights
    assert (_hf_log_probs(_load(target), arch) - actor).abs().max().item() <= 1e-5
    assert (root / "adapters" / ADAPTER_DIR / "adapter_model.safetensors").is_file()
