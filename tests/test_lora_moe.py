"""LoRA on a mixture of experts (tiny_qwen3_moe): the experts' adapters and the attention's, at TP=2 (sequence
parallel, the experts' communication left to the dispatcher), EP=2 and PP=2, against the chain rule on the merged
model. A model whose weights are W + s·B·A has weight gradients G; the adapters' gradients must then be
dA = s·Bᵀ·G and dB = s·G·Aᵀ — an oracle that shares nothing with the side path under test."""

import pytest
import torch

from mindrl.algorithms.policy_loss import LossConfig
from mindrl.config import ParallelConfig, load_model_arch
from mindrl.config.lora import TARGETS, LoraConfig
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import lora, sharding
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker
from tests.grads import reduced_grads
from tests.test_lora import ROWS, _adapter_names, _adapter_values, _batch, _joined, _set_adapters

R, ALPHA = 4, 8.0
SCALE = ALPHA / R
LAYOUTS = [ParallelConfig(2, 1), ParallelConfig(1, 1, expert_model_parallel_size=2), ParallelConfig(1, 2)]
LOSS = LossConfig(use_kl_loss=False, entropy_coeff=0.0)


def _config(lora_cfg: LoraConfig) -> ActorConfig:
    return ActorConfig(lr=1e-2, mini_batch_size=ROWS, micro_batch_size=2, clip_grad=1e9, prompt_packing="off",
                       lora=lora_cfg, loss=LOSS)


def _layouts(rank: int, full: dict, adapters: dict, root: str) -> list[dict]:
    arch = load_model_arch("tiny_qwen3_moe")
    batch = _batch(arch.padded_vocab_size)
    out = []
    for par in LAYOUTS:
        release_model_parallel()
        actor = ActorWorker(arch, par, _config(LoraConfig(TARGETS, R, ALPHA)), weights=full)
        _set_adapters(actor, adapters)
        if par.ep > 1:  # a checkpoint for the export test (the adapters as set), its experts on two ranks
            actor.save_checkpoint(root, 1, {"initial_weights": None})
        actor.update(batch)
        out.append({"tp": actor.tp_rank, "pp": actor.pp_rank, "dp": actor.dp_rank, "ep": actor.ep_rank,
                    "grads": reduced_grads(actor), "full": _adapter_names(actor)})
    return out


def _merged_grads(rank: int, merged: dict) -> dict[str, torch.Tensor]:
    """The weight gradients of the plain model holding the merged weights (TP=1, one rank)."""
    arch = load_model_arch("tiny_qwen3_moe")
    actor = ActorWorker(arch, ParallelConfig(1, 1), _config(LoraConfig()), weights=merged)
    actor.update(_batch(arch.padded_vocab_size))
    return reduced_grads(actor)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    arch = load_model_arch("tiny_qwen3_moe")
    full = sharding.random_full_state_dict(arch, seed=6)
    adapters = _adapter_values(arch, r=R)
    merged = dict(full)
    for name in adapters:
        if name.endswith(lora.A_NAME):
            weight = name.removesuffix(f".{lora.A_NAME}") + ".weight"
            merged[weight] = lora.merged(full[weight], adapters[name],
                                         adapters[name.replace(lora.A_NAME, lora.B_NAME)], SCALE)
    oracle = run_ranks(_merged_grads, 1, merged)[0]
    root = tmp_path_factory.mktemp("moe_lora")
    return full, adapters, oracle, run_ranks(_layouts, 2, full, adapters, str(root / "ckpt")), root


def test_expert_and_attention_adapter_gradients_follow_the_chain_rule_at_tp2_ep2_pp2(moe_runs):
    _, adapters, oracle, ranks, _ = moe_runs
    expected = {}
    for name in adapters:
        module, _, half = name.rpartition(f".{lora.ADAPTER}.")
        grad = oracle[f"{module}.weight"]
        other = adapters[f"{module}.{lora.ADAPTER}.{'lora_B' if half == 'lora_A' else 'lora_A'}"]
        expected[name] = SCALE * (other.t() @ grad if half == "lora_A" else grad @ other.t())
    assert any(".experts." in name for name in expected)
    largest = max(g.abs().max().item() for g in expected.values())
    assert largest > 1e-4
    for index, par in enumerate(LAYOUTS):
        where = f"TP={par.tp} EP={par.ep} PP={par.pp}"
        got = _joined([rank[index] for rank in ranks], par)
        assert got.keys() == expected.keys(), where
        for name, grad in expected.items():
            diff = (got[name] - grad).abs().max().item()
            assert diff <= 1e-5 * largest, f"{where}: gradient of {name} differs from the chain rule's by {diff:.2e}"


def test_a_moe_lora_checkpoint_exports_merged_weights_but_no_peft_folder(moe_runs):
    """At EP=2 the merged HF export holds every expert's W + s·B·A; a PEFT folder is refused in one sentence, since
    transformers' fused experts have no module PEFT could put the experts' adapters on."""
    from safetensors.torch import load_file

    from mindrl.ckpt_convert.mcore2hf import mcore_to_hf
    from mindrl.config import ConfigError

    full, adapters, _, _, root = moe_runs
    with pytest.raises(ConfigError, match="fuses a mixture of experts' experts into 3-D parameters"):
        mcore_to_hf(root / "ckpt", root / "refused", lora_adapter_dir=root / "adapter", progress=False)
    assert not (root / "refused").exists() and not (root / "adapter").exists()
    target = mcore_to_hf(root / "ckpt", root / "hf", progress=False)
    hf = {}
    for file in sorted(target.glob("*.safetensors")):
        hf.update(load_file(file))
    for mg_name, hf_name in (("decoder.layers.1.mlp.experts.local_experts.5.linear_fc2",  # on EP rank 1
                              "model.layers.1.mlp.experts.5.down_proj.weight"),
                             ("decoder.layers.0.self_attention.linear_proj", "model.layers.0.self_attn.o_proj.weight")):
        expected = lora.merged(full[f"{mg_name}.weight"], adapters[f"{mg_name}.{lora.A_NAME}"],
                               adapters[f"{mg_name}.{lora.B_NAME}"], SCALE)
        assert torch.equal(hf[hf_name], expected), hf_name
