"""Reading the full, data-parallel-reduced gradients out of an actor (for layout checks)."""

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mindrl.workers.megatron_worker import ActorWorker


def reduced_grads(worker: ActorWorker) -> dict[str, torch.Tensor]:
    """This rank's stage gradients, reduced over data-parallel ranks.

    The distributed optimizer reduce-scatters the grad buffers: each data-parallel rank ends
    with the reduced values of its own equal shard only, so gather the shards back.
    """
    # the optimizer shards over the data- and context-parallel ranks together (those hold the same weights), the
    # experts' over their own data-parallel ranks
    for buffers, group in ((worker.ddp.buffers, parallel_state.get_data_parallel_group(with_context_parallel=True)),
                           (worker.ddp.expert_parallel_buffers, parallel_state.get_expert_data_parallel_group())):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        for buffer in buffers:
            for bucket in buffer.buckets:
                shards = list(bucket.grad_data.chunk(size))
                dist.all_gather(shards, shards[rank].clone(), group=group)
    return {name: p.main_grad.detach().clone() for name, p in worker.model.named_parameters() if p.requires_grad}


def assert_gradients_equal(runs: list[dict], expected: dict[str, torch.Tensor], arch, par, where: str) -> None:
    """The gradients the ranks of one layout returned (each a dict with `tp`, `pp`, `dp` and `grads`), merged and
    under HF's names, equal `expected` (HF's autograd) within 1e-5 of each tensor's largest."""
    from mindrl.models import sharding
    from tests.hf_models import mcore_to_hf_state

    stages = {(r["tp"], r["pp"]): r["grads"] for r in runs if r["dp"] == 0}
    got = mcore_to_hf_state(sharding.merge_state_dicts(stages, arch, par), arch)
    for name, grad in expected.items():
        diff = (got[name] - grad).abs().max().item()
        assert diff <= 1e-5 * grad.abs().max().item() + 1e-8, f"{where}: gradient of {name} differs by {diff:.2e}"
