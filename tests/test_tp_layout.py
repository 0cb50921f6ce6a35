"""The copy instructions of the TP cut give exactly what the mapping gives, in both directions."""

import pytest
import torch

from mindrl.config import ParallelConfig
from mindrl.models import hf_mapping as hfm
from mindrl.models import sharding, tp_layout
from tests.hf_models import build_hf_model

CASES = [("qwen2", 1), ("qwen2", 2), ("llama3", 2), ("llama3", 4), ("qwen3", 2)]


def _hf_state(kind: str) -> tuple:
    model = build_hf_model(kind, seed=3)
    arch = hfm.arch_from_hf_config(model.config.to_dict(), kind)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    if arch.tied_embeddings:
        state.pop(hfm.OUTPUT[0])
    return arch, state


def _mapped_shards(arch, state: dict, tp: int) -> dict[str, list[torch.Tensor]]:
    """Every Megatron tensor's TP slices the reference way: fuse the full tensors, then cut."""
    par = ParallelConfig(tp, 1)
    full = {hfm.EMBEDDING[1]: state[hfm.EMBEDDING[0]], hfm.FINAL_NORM[1]: state[hfm.FINAL_NORM[0]]}
    if not arch.tied_embeddings:
        full[hfm.OUTPUT[1]] = state[hfm.OUTPUT[0]]
    for i in range(arch.num_layers):
        layer_arch = arch.layer_arch(i)
        layer = {n: state[hfm.hf_layer_prefix(i) + n] for n in hfm.hf_layer_names(layer_arch)}
        full.update({hfm.mcore_layer_prefix(i) + s: t for s, t in hfm.hf_to_mcore_layer(layer, layer_arch).items()})
    return {name: sharding.split_full_tensor(name, tensor, arch, par) for name, tensor in full.items()}


@pytest.mark.parametrize("kind, tp", CASES)
def test_rank_tensors_built_from_pieces_equal_the_mapping(kind, tp):
    arch, state = _hf_state(kind)
    expected = _mapped_shards(arch, state, tp)
    for name, shards in expected.items():
        pieces = tp_layout.rank_pieces(arch, tp, name)
        for rank, shard in enumerate(shards):
            built = tp_layout.fill_rank_tensor(torch.full_like(shard, float("nan")), pieces[rank], state, tp)
            assert torch.equal(built, shard), f"{name} rank {rank}"


@pytest.mark.parametrize("kind, tp", CASES)
def test_hf_tensors_built_from_shards_equal_the_originals(kind, tp):
    arch, state = _hf_state(kind)
    shards = _mapped_shards(arch, state, tp)
    by_hf = tp_layout.hf_pieces(arch, tp, list(shards))
    assert set(by_hf) == set(state)
    for hf_name, pieces in by_hf.items():
        built = tp_layout.fill_hf_tensor(torch.full_like(state[hf_name], float("nan")), pieces, shards, tp)
        assert torch.equal(built, state[hf_name]), hf_name
        assert sum(p.count * (1 if p.col_block is None else 1 / tp) for _, _, p in pieces) == state[hf_name].shape[0]


def test_fused_tensors_are_few_long_runs():
    """QKV of one query group per rank is three runs (its q heads, k, v); fc1 is two (gate, up)."""
    arch, _ = _hf_state("qwen2")
    qkv = tp_layout.rank_pieces(arch, 2, "decoder.layers.0.self_attention.linear_qkv.weight")
    assert [[p.hf_name.rsplit(".", 2)[-2] for p in rank] for rank in qkv] == [["q_proj", "k_proj", "v_proj"]] * 2
    fc1 = tp_layout.rank_pieces(arch, 2, "decoder.layers.0.mlp.linear_fc1.weight")
    assert [len(rank) for rank in fc1] == [2, 2]
    proj = tp_layout.rank_pieces(arch, 2, "decoder.layers.0.self_attention.linear_proj.weight")
    assert [[p.col_block for p in rank] for rank in proj] == [[0], [1]]


@pytest.mark.parametrize("kind", ["qwen2", "llama3", "qwen3"])
def test_layer_suffixes_are_the_mappings_names_in_its_order(kind):
    """A converter writing in this order writes the rank files the mapping would."""
    arch, state = _hf_state(kind)
    layer = {n: state[hfm.hf_layer_prefix(0) + n] for n in hfm.hf_layer_names(arch)}
    assert tp_layout.layer_suffixes(arch, 0) == list(hfm.hf_to_mcore_layer(layer, arch))
