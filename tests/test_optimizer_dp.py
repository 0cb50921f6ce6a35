"""Megatron's distributed optimizer at DP=2 (and PP=2×DP=2) on gloo: it learns, replicas agree."""

import pytest
import torch

from mindrl.config import ParallelConfig, load_model_arch
from mindrl.launch import run_ranks
from mindrl.models.parity import train_replicas

STEPS = 4


def _train(rank: int, tp: int, pp: int):
    return train_replicas(rank, load_model_arch("tiny_qwen"), ParallelConfig(tp, pp), steps=STEPS)


@pytest.mark.parametrize("world, tp, pp", [(2, 1, 1), (4, 1, 2)])
def test_distributed_optimizer_lowers_loss_and_keeps_replicas_identical(world, tp, pp):
    results = run_ranks(_train, world, tp, pp)
    assert all(r.optimizers == {"DistributedOptimizer"} for r in results)
    for r in results:
        if r.pp_rank == pp - 1:
            assert len(r.losses) == STEPS
            assert r.losses[-1] < r.losses[0] - 0.3, r.losses
        else:
            assert r.losses == []
    for stage in range(pp):
        replicas = [r for r in results if r.pp_rank == stage]
        assert len(replicas) == 2
        a, b = (r.params for r in replicas)
        for name in a:
            assert torch.equal(a[name], b[name]), f"DP replicas differ in {name}"
            assert not torch.equal(a[name], replicas[0].initial[name]), f"{name} was not updated"
    if pp > 1:  # tied embedding: the last stage's output layer must track the first stage's embedding
        first = next(r for r in results if r.pp_rank == 0).params["embedding.word_embeddings.weight"]
        last = next(r for r in results if r.pp_rank == pp - 1).params["output_layer.weight"]
        assert torch.allclose(first, last, atol=1e-6)
