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
    group = parallel_state.get_data_parallel_group()
    for buffer in worker.ddp.buffers:
        for bucket in buffer.buckets:
            shards = list(bucket.grad_data.chunk(worker.dp_size))
            dist.all_gather(shards, shards[worker.dp_rank].clone(), group=group)
    return {name: p.main_grad.detach().clone() for name, p in worker.model.named_parameters()}
