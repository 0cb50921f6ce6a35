"""TP/PP cuts of the Megatron weight layout: exact round trips and the cuts Megatron expects."""

import pytest
import torch

from mindrl.config import ModelArch, ParallelConfig, load_model_arch
from mindrl.models import sharding

LLAMA_LIKE = ModelArch.from_dict("llama_like", dict(
    num_layers=4, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
    padded_vocab_size=1000, make_vocab_size_divisible_by=1, max_position_embeddings=64,
    untie_embeddings_and_output_weights=True))


@pytest.mark.parametrize("arch", [load_model_arch("tiny_qwen"), LLAMA_LIKE], ids=["qwen", "llama"])
@pytest.mark.parametrize("par", [ParallelConfig(1, 1), ParallelConfig(2, 1), ParallelConfig(2, 2),
                                 ParallelConfig(1, 2, num_layer_list="3,1")], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shard_then_merge_is_bit_exact(arch, par, dtype):
    full = sharding.random_full_state_dict(arch, seed=3, dtype=dtype)
    stages = {(t, p): sharding.shard_state_dict(full, arch, par, t, p)
              for t in range(par.tp) for p in range(par.pp)}
    merged = sharding.merge_state_dicts(stages, arch, par)
    assert list(merged) == list(full)
    for name in full:
        assert merged[name].dtype == dtype and torch.equal(merged[name], full[name]), name


def test_vocab_is_padded_with_zero_rows_for_tp():
    arch = LLAMA_LIKE  # 1000 rows: TP=8 needs 1000 → 1000 (divisible); TP=16 → 1008
    assert arch.vocab_size_for(16) == 1008
    full = sharding.random_full_state_dict(arch)
    par = ParallelConfig(16, 1)
    arch16 = ModelArch(**{**arch.__dict__, "num_attention_heads": 16, "num_query_groups": 16})
    last = sharding.shard_state_dict(full, arch16, par, 15, 0)["output_layer.weight"]
    assert last.shape == (63, 128)
    assert torch.equal(last[-8:], torch.zeros(8, 128))
    assert torch.equal(last[:-8], full["output_layer.weight"][-55:])


def test_swiglu_fc1_is_cut_per_half():
    """Each TP rank must hold [gate slice; up slice], not a contiguous chunk of [gate; up]."""
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    gate, up = full[name].chunk(2)
    rank0 = sharding.shard_state_dict(full, arch, ParallelConfig(2, 1), 0, 0)[name]
    assert torch.equal(rank0, torch.cat([gate[:176], up[:176]]))


def test_qkv_is_cut_by_whole_query_groups():
    arch = load_model_arch("tiny_qwen")  # 2 groups of (2 q heads + k + v) × head_dim 32 = 128 rows each
    full = sharding.random_full_state_dict(arch)
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    rank1 = sharding.shard_state_dict(full, arch, ParallelConfig(2, 1), 1, 0)[name]
    assert torch.equal(rank1, full[name][128:])


def test_pipeline_stages_hold_their_layers_and_ends():
    arch = load_model_arch("tiny_qwen")
    par = ParallelConfig(1, 2, num_layer_list="1,3")
    first = sharding.stage_names(arch, par, 0)
    last = sharding.stage_names(arch, par, 1)
    assert "embedding.word_embeddings.weight" in first and "decoder.final_layernorm.weight" in last
    assert first["decoder.layers.0.input_layernorm.weight"] == "decoder.layers.0.input_layernorm.weight"
    assert last["decoder.layers.3.input_layernorm.weight"] == "decoder.layers.2.input_layernorm.weight"
    assert not any(".layers.1." in n for n in first)
    # tied embeddings: the last stage carries Megatron's shared copy as output_layer.weight
    full = sharding.random_full_state_dict(arch)
    shard = sharding.shard_state_dict(full, arch, par, 0, 1)
    assert torch.equal(shard["output_layer.weight"], full["embedding.word_embeddings.weight"])


@pytest.mark.parametrize("tp", [1, 2, 4, 16])
def test_vocab_rows_agree_with_the_split(tp):
    arch = ModelArch(**{**LLAMA_LIKE.__dict__, "num_attention_heads": 16, "num_query_groups": 16})
    full = sharding.random_full_state_dict(arch)["output_layer.weight"]
    par = ParallelConfig(tp, 1)
    for rank, piece in enumerate(sharding.split_full_tensor("output_layer.weight", full, arch, par)):
        start, stop, pad = sharding.vocab_rows(arch, par, rank)
        assert torch.equal(piece, sharding.pad_vocab(full[start:stop], stop - start + pad))
