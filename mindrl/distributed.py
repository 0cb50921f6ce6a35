"""torch.distributed and Megatron parallel-state set-up for one process.

Process groups use the platform's backend (gloo / nccl / hccl). Every rank seeds the
same way, so data-parallel replicas start from identical weights without a broadcast.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from mindrl.config import ConfigError, ParallelConfig, validate_parallel
from mindrl.config.model import ModelArch
from mindrl.platform import Platform, get_platform
from mindrl.platform.precision import Bf16Speed, Precision, choose


def init_distributed(rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
                     local_rank: int | None = None, platform: Platform | None = None,
                     timeout_s: float = 600.0, store_is_served: bool = False) -> Platform:
    """Join the default process group; returns the platform it was set up on.

    Rank 0 serves the rendezvous store at master_addr:master_port, unless `store_is_served`
    says someone else (the launching process) already does; then every rank is a client.
    """
    platform = platform or get_platform()
    local_rank = rank if local_rank is None else local_rank
    platform.set_device(local_rank)
    # torch.distributed's env:// names, which vLLM's external_launcher reads (infer TP > 1) besides ours
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
    if master_addr.startswith("127."):
        # gloo picks the interface for rank-to-rank links from the host name, which may resolve off-host; a
        # loopback rendezvous means a single-machine run, so keep it all on lo. Megatron and vLLM make gloo
        # groups beside NCCL / HCCL ones too, so this holds whatever the backend.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=timeout_s)
    store = None
    if store_is_served:
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(platform.dist_backend, rank=rank, world_size=world_size, timeout=timeout, store=store)
    if platform.dist_backend == "gloo":
        # gloo's mesh is up on one side of a link before the other has read its handshake; a rank that went on and
        # ended meanwhile (a short job, a failure) reset the link under its peer ('Connection closed by peer' in
        # connectFullMesh, 1 launch in ~40 on two loaded cores). No rank leaves until every link is up.
        dist.barrier()
    return platform


def init_model_parallel(par: ParallelConfig, seed: int = 1234, arch: ModelArch | None = None) -> None:
    """Set up Megatron's TP/PP/DP groups for `par` (or join them), and seed the generators.

    Validates `par` against `arch` and the world size first. Roles colocated in one process
    (the reference beside the actor) share the groups: a second call with the same TP×PP
    joins them, leaving the first model's DDP, optimizer and pipeline state untouched.
    Megatron keeps one layout per process — its collectives read the global groups at call
    time — so a second call with a different layout is refused: it would silently run the
    first model's vocab-parallel loss and gradient reductions over the wrong groups. Switch
    layouts deliberately with `release_model_parallel()` once the old models are dropped.
    """
    world_size = dist.get_world_size()
    if arch is not None:
        validate_parallel(arch, par, world_size)
    elif world_size % par.ranks_per_replica:
        raise ConfigError(f"world size {world_size} is not divisible by TP×PP×EP = {par.tp}×{par.pp}×{par.ep}; use a "
                          f"multiple of {par.ranks_per_replica} ranks.")
    elif world_size % par.model_ranks:
        raise ConfigError(f"world size {world_size} is not divisible by TP×PP×CP = {par.tp}×{par.pp}×{par.cp}; use a "
                          f"multiple of {par.model_ranks} ranks.")
    torch.manual_seed(seed)
    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_world_size(),
                   parallel_state.get_context_parallel_world_size())
        if current != (par.tp, par.pp, par.ep, par.cp):
            raise ConfigError(
                f"this process already hosts a model at TP={current[0]} PP={current[1]} EP={current[2]} "
                f"CP={current[3]}; a role colocated with it must use the same tensor, pipeline, expert and context "
                f"parallel sizes (asked for TP={par.tp} PP={par.pp} EP={par.ep} CP={par.cp}), or run on its own "
                f"devices.")
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
        context_parallel_size=par.cp, expert_model_parallel_size=par.ep, expert_tensor_parallel_size=par.tp)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def release_model_parallel() -> None:
    """Forget Megatron's groups so the next `init_model_parallel` may pick another layout.

    Models, DDP wrappers and optimizers built on the old groups must not be used afterwards.
    """
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def destroy() -> None:
    """Tear down Megatron's groups and the default process group, if present."""
    release_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def agreed_precision(setting: bool | str, section: str, resumed_bf16: bool | None = None) -> Precision:
    """What every rank of the world trains in (a collective): bf16 counts as fast only where it is fast on
    every rank, and the slowest rank's measurement is the one reported."""
    speed = None
    if setting is True or (setting == "auto" and resumed_bf16 is None):
        speeds: list[Bf16Speed | None] = [None] * dist.get_world_size()
        dist.all_gather_object(speeds, get_platform().bf16_speed())
        speed = min(speeds, key=lambda s: (s.fast, math.inf if s.ratio is None else s.ratio))
    return choose(setting, speed, section, resumed_bf16)
