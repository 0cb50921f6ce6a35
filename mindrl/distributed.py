"""torch.distributed and Megatron parallel-state set-up for one process.

Process groups use the platform's backend (gloo / nccl / hccl). Every rank seeds the
same way, so data-parallel replicas start from identical weights without a broadcast.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from mindrl.config import ParallelConfig, validate_parallel
from mindrl.config.model import ModelArch
from mindrl.platform import Platform, get_platform


def init_distributed(rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
                     local_rank: int | None = None, platform: Platform | None = None,
                     timeout_s: float = 600.0) -> Platform:
    """Join the default process group; returns the platform it was set up on."""
    platform = platform or get_platform()
    platform.set_device(rank if local_rank is None else local_rank)
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    if master_addr.startswith("127.") and platform.dist_backend == "gloo":
        # gloo picks the interface for rank-to-rank links from the host name, which may resolve
        # off-host; a loopback rendezvous means a single-machine run, so keep it all on lo.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(platform.dist_backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return platform


def init_model_parallel(par: ParallelConfig, seed: int = 1234, arch: ModelArch | None = None) -> None:
    """(Re)initialise Megatron's TP/PP/DP groups for `par` and seed every generator.

    Validates `par` against `arch` and the world size first. Safe to call again with a
    different layout in the same processes (the previous groups are destroyed).
    """
    world_size = dist.get_world_size()
    if arch is not None:
        validate_parallel(arch, par, world_size)
    elif world_size % (par.tp * par.pp):
        raise ValueError(f"world size {world_size} is not divisible by TP×PP = {par.tp}×{par.pp}.")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy() -> None:
    """Tear down Megatron's groups and the default process group, if present."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
