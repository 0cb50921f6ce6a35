"""DeepSeek-V3 checkpoints as MindSpeed-LLM and Megatron-LM's Transformer Engine spec write them convert exactly.

The attention tensors of each foreign checkpoint are built here from the HF model's own tensors, the way each
writer's converter lays them out (MindSpeed-LLM: both down projections fused into one `linear_qkv` every TP rank
holds whole, `linear_qb` / `linear_kvb` or `linear_q_up_proj` / `linear_kv_up_proj`, `k_layernorm`, or the up
projections split per head; Transformer Engine: whole down projections, latent norms fused into the up
projections), independently of mindrl's mapping; the rest of each layer comes from a mindrl conversion. Converting
them back must give the HF files bit for bit.
"""

import argparse
import json
from pathlib import Path

import pytest
import torch

from mindrl.checkpoint import megatron as mg
from mindrl.ckpt_convert import hf_to_mcore, mcore_to_hf, mcore_to_mcore
from mindrl.config import ConfigError
from tests.hf_models import build_hf_model, save_hf_model
from tests.test_foreign_checkpoints import assert_same_hf_weights, megatron_lm_args, read_hf

TP = 2
STYLES = ("mindspeed_qb", "mindspeed_up", "mindspeed_mm_split", "megatron_lm_te")


def _attention(hf: dict[str, torch.Tensor], config: dict, layer: int, style: str, t: int) -> dict[str, torch.Tensor]:
    """Layer `layer`'s attention tensors on TP rank `t`, as `style`'s converter writes them from HF's."""
    src, out = f"model.layers.{layer}.self_attn.", f"decoder.layers.{layer}.self_attention."
    heads, nope, rope, value = (config[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                                    "v_head_dim"))
    kv_a, kv_b, kv_norm = (hf[f"{src}{name}.weight"] for name in ("kv_a_proj_with_mqa", "kv_b_proj", "kv_a_layernorm"))
    tensors = {"linear_proj.weight": hf[src + "o_proj.weight"].chunk(TP, dim=1)[t]}
    if config["q_lora_rank"] is None:  # DeepSeek-V2-Lite's shape: the query is one projection, fused whole as well
        tensors.update({"linear_qkv.weight": torch.cat([hf[src + "q_proj.weight"], kv_a]),
                        "linear_kvb.weight": kv_b.chunk(TP)[t], "k_layernorm.weight": kv_norm})
        return {out + name: tensor.clone() for name, tensor in tensors.items()}
    q_a, q_b, q_norm = (hf[f"{src}{name}.weight"] for name in ("q_a_proj", "q_b_proj", "q_a_layernorm"))
    if style == "megatron_lm_te":
        tensors.update({"linear_q_down_proj.weight": q_a, "linear_kv_down_proj.weight": kv_a,
                        "linear_q_up_proj.weight": q_b.chunk(TP)[t], "linear_kv_up_proj.weight": kv_b.chunk(TP)[t],
                        "linear_q_up_proj.layer_norm_weight": q_norm, "linear_kv_up_proj.layer_norm_weight": kv_norm})
        return {out + name: tensor.clone() for name, tensor in tensors.items()}
    tensors["linear_qkv.weight"] = torch.cat([q_a, kv_a])  # whole on every rank
    tensors["q_layernorm.weight"] = q_norm
    if style == "mindspeed_mm_split":
        q_nope, q_rope = q_b.reshape(heads, nope + rope, -1).split([nope, rope], dim=1)
        kv_nope, v = kv_b.reshape(heads, nope + value, -1).split([nope, value], dim=1)
        for name, half in (("linear_qk_nope", q_nope), ("linear_qk_rope", q_rope), ("linear_kv_nope", kv_nope),
                           ("linear_v", v)):
            tensors[f"{name}.weight"] = half.reshape(-1, half.shape[-1]).chunk(TP)[t]
    else:
        q_up, kv_up = ("linear_qb", "linear_kvb") if style == "mindspeed_qb" else ("linear_q_up_proj",
                                                                                    "linear_kv_up_proj")
        tensors.update({f"{q_up}.weight": q_b.chunk(TP)[t], f"{kv_up}.weight": kv_b.chunk(TP)[t]})
    tensors["k_layernorm.weight" if style == "mindspeed_qb" else "kv_layernorm.weight"] = kv_norm
    return {out + name: tensor.clone() for name, tensor in tensors.items()}


def _args(config: dict, style: str) -> argparse.Namespace:
    moe = dict(num_experts=config["n_routed_experts"], moe_router_topk=config["num_experts_per_tok"],
               moe_ffn_hidden_size=config["moe_intermediate_size"], n_shared_experts=config["n_shared_experts"],
               first_k_dense_replace=config["first_k_dense_replace"], moe_router_score_function="sigmoid",
               moe_router_enable_expert_bias=True, moe_router_num_groups=config["n_group"],
               moe_token_dispatcher_type="alltoall",
               moe_router_group_topk=config["topk_group"], norm_topk_prob=True,
               moe_router_topk_scaling_factor=config["routed_scaling_factor"], qk_layernorm=True,
               q_lora_rank=config["q_lora_rank"], kv_lora_rank=config["kv_lora_rank"], v_head_dim=config["v_head_dim"])
    sizes = (config["qk_nope_head_dim"], config["qk_rope_head_dim"])
    scaling = config.get("rope_scaling") or config["rope_parameters"]
    if style == "megatron_lm_te":  # Megatron-LM's MLA keeps its YaRN in keys of its own: read from the HF config
        extra = dict(multi_latent_attention=True, qk_head_dim=sizes[0], qk_pos_emb_head_dim=sizes[1],
                     rope_type="yarn", rotary_scaling_factor=scaling["factor"])
    else:
        extra = dict(rope_scaling_type="yarn", rope_scaling_factor=scaling["factor"], beta_fast=scaling["beta_fast"],
                     beta_slow=scaling["beta_slow"], rope_scaling_mscale=scaling["mscale"],
                     rope_scaling_mscale_all_dim=scaling["mscale_all_dim"],
                     rope_scaling_original_max_position_embeddings=scaling["original_max_position_embeddings"],
                     make_vocab_size_divisible_by=1)
        if style == "mindspeed_qb":  # older MindSpeed-LLM: its own flag and HF's size names, beside Megatron's off flag
            extra.update(multi_head_latent_attention=True, qk_nope_head_dim=sizes[0], qk_rope_head_dim=sizes[1])
        else:
            extra.update(multi_latent_attention=True, qk_head_dim=sizes[0], qk_pos_emb_head_dim=sizes[1])
    values = megatron_lm_args(config, TP, 1, config["vocab_size"],
                              "megatron-lm" if style == "megatron_lm_te" else "mindspeed", **moe, **extra)
    return argparse.Namespace(**values)


def _write(src: Path, out: Path, hf: dict[str, torch.Tensor], config: dict, style: str) -> Path:
    for t in range(TP):
        model = torch.load(src / "release" / f"mp_rank_{t:02d}" / "model_optim_rng.pt",
                           weights_only=True)["model"]
        model = {name: tensor for name, tensor in model.items() if ".self_attention." not in name}
        for layer in range(config["num_hidden_layers"]):
            model.update(_attention(hf, config, layer, style, t))
            norm = f"decoder.layers.{layer}.pre_mlp_layernorm.weight"
            if style == "megatron_lm_te" and layer < config["first_k_dense_replace"]:  # fused into the dense MLP
                model[f"decoder.layers.{layer}.mlp.linear_fc1.layer_norm_weight"] = model.pop(norm)
        path = out / "iter_0000010" / f"mp_rank_{t:02d}" / "model_optim_rng.pt"
        path.parent.mkdir(parents=True)
        torch.save({"checkpoint_version": 3.0, "iteration": 10, "args": _args(config, style), "model": model}, path)
    (out / "latest_checkpointed_iteration.txt").write_text("10")
    return out


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("foreign_mla")
    hf_dir = save_hf_model(build_hf_model("deepseek_v3", seed=5), root / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    src = hf_to_mcore(hf_dir, root / "mindrl", "deepseek_v3", TP, 1, params_dtype=torch.float32, progress=False)
    return hf_dir, config, src, read_hf(hf_dir)


@pytest.mark.parametrize("style", STYLES)
def test_foreign_multi_latent_attention_converts_to_the_original_hf_weights(style, deepseek, tmp_path):
    hf_dir, config, src, hf = deepseek
    root = _write(src, tmp_path / style, hf, config, style)
    assert mg.load_args(root).tensor_model_parallel_size == TP
    mcore_to_hf(root, tmp_path / "back", hf_config_dir=hf_dir, progress=False)
    assert_same_hf_weights(tmp_path / "back", hf_dir)


def test_a_mindspeed_llm_deepseek_checkpoint_reshards_and_reads_without_its_hf_config(deepseek, tmp_path):
    """Its args alone describe the model (older MindSpeed-LLM's names); a rank reads as mindrl's, and re-sharded
    to TP=1 it converts to the HF weights."""
    hf_dir, config, src, hf = deepseek
    root = _write(src, tmp_path / "mindspeed", hf, config, "mindspeed_qb")
    own = mg.load_rank(src, 1, 0)["model"]  # as a trainer's `load` reads a rank, the model checked first
    theirs = mg.load_rank(root, 1, 0, expect_arch=mg.arch_of(mg.load_args(src)))["model"]
    assert theirs.keys() == own.keys() and all(torch.equal(theirs[name], own[name]) for name in own)
    mcore_to_mcore(root, tmp_path / "tp1", tp=1, progress=False)
    model = mg.load_rank(tmp_path / "tp1", 0, 0)["model"]
    assert model["decoder.layers.0.self_attention.linear_kv_down_proj.weight"].shape == (
        config["kv_lora_rank"] + config["qk_rope_head_dim"], config["hidden_size"])
    mcore_to_hf(tmp_path / "tp1", tmp_path / "back", hf_config_dir=hf_dir, progress=False)
    assert_same_hf_weights(tmp_path / "back", hf_dir)


def test_a_mindspeed_llm_checkpoint_without_a_query_latent_converts(tmp_path):
    """`linear_qkv` then holds the whole query projection over the key-value down projection; each TP rank keeps
    its heads of the first and its rows of the second."""
    hf_dir = save_hf_model(build_hf_model("deepseek_v3", seed=6, q_lora_rank=None), tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    src = hf_to_mcore(hf_dir, tmp_path / "mindrl", "deepseek_v3", TP, 1, params_dtype=torch.float32, progress=False)
    root = _write(src, tmp_path / "mindspeed", read_hf(hf_dir), config, "mindspeed_qb")
    mcore_to_hf(root, tmp_path / "back", hf_config_dir=hf_dir, progress=False)
    assert_same_hf_weights(tmp_path / "back", hf_dir)


@pytest.mark.parametrize("damage, message", [
    ("drop_half", r"linear_q_up_proj.weight is stored split per head \(MindSpeed-LLM's --mla-mm-split\), but one of "
                  r"its two halves is missing"),
    ("short_qkv", r"linear_qkv.weight has shape \(55, 64\), not the 56 rows of the query and key-value down "
                  r"projections the args' MLA sizes give"),
])
def test_damaged_foreign_attention_is_one_sentence(damage, message, deepseek, tmp_path):
    hf_dir, config, src, hf = deepseek
    root = _write(src, tmp_path / "damaged", hf, config, "mindspeed_mm_split")
    path = root / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    model = state["model"]
    if damage == "drop_half":
        del model["decoder.layers.1.self_attention.linear_qk_rope.weight"]
    else:
        name = "decoder.layers.1.self_attention.linear_qkv.weight"
        model[name] = model[name][1:]
    torch.save(state, path)
    with pytest.raises(ConfigError, match=message):
        mcore_to_hf(root, tmp_path / "back", hf_config_dir=hf_dir, progress=False)
    assert not (tmp_path / "back").exists()
