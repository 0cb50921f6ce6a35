"""Moving the actor's weights, at any TP/PP layout, into a rollout engine.

Every rank ends up handing its engine every HF tensor of the model, in one fixed order:
for each Megatron tensor, the pipeline stage holding it gathers its TP shards inside the TP
group (an expert's: the expert-parallel rank holding it, which then broadcasts them over the
expert-parallel group) and broadcasts them over the pipeline group; each rank then fills the HF tensors that
Megatron tensor feeds straight from the shards (tp_layout: one copy, TP vocabulary padding
left out, so the engine can never sample a padding id) in the engine's dtype, and passes
them on in buckets of at most `bucket_bytes` (a tensor larger than a bucket goes alone). No
rank ever holds more than one Megatron tensor's shards plus one bucket.

After every bucket the ranks agree on whether it loaded everywhere, so a failure on any rank
stops every rank with the same error instead of leaving the others waiting in a collective;
the engine is marked as holding half-updated weights and refuses to generate until the next
complete sync has replaced every tensor.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mindrl.config import ModelArch, ParallelConfig
from mindrl.models import hf_mapping as hfm
from mindrl.models import lora, sharding, tp_layout
from mindrl.platform import get_platform
from mindrl.rollout.base import RolloutEngine


class WeightSyncError(RuntimeError):
    """A weight sync failed part way (the engine refuses to generate until a complete sync), or its check failed."""


@dataclass
class SyncStats:
    """Where a sync spent its time, and what it moved."""

    gather_s: float = 0.0
    convert_s: float = 0.0
    load_s: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    digests: dict[str, str] = field(default_factory=dict)

    def seconds(self) -> float:
        return self.gather_s + self.convert_s + self.load_s

    def metrics(self) -> dict[str, float]:
        total = self.seconds()
        return {"sync/seconds": total, "sync/gather_seconds": self.gather_s, "sync/convert_seconds": self.convert_s,
                "sync/load_seconds": self.load_s, "sync/gigabytes": self.bytes / 1e9,
                "sync/gb_per_s": self.bytes / 1e9 / total if total else 0.0, "sync/buckets": float(self.buckets)}


def sync_weights(engine: RolloutEngine, model: torch.nn.Module, arch: ModelArch, par: ParallelConfig,
                 dtype: torch.dtype, bucket_bytes: int, digests: bool = False) -> SyncStats:
    """Load the actor stage `model` (this rank's part) into `engine`; collective over the actor's ranks.

    With `digests`, the stats hold a digest of every HF tensor handed to this rank's engine.
    """
    stats = SyncStats()
    if engine.shares_actor_weights:
        return stats
    for bucket in hf_buckets(model, arch, par, dtype, bucket_bytes, stats, digests):
        _load(engine, bucket, stats)
    start = time.perf_counter()
    _agree(lambda: engine.finish_weight_update(), engine, "finishing the update")
    stats.load_s += time.perf_counter() - start
    return stats


def hf_buckets(model: torch.nn.Module, arch: ModelArch, par: ParallelConfig, dtype: torch.dtype,
               bucket_bytes: int, stats: SyncStats,
               digests: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`hf_tensors` in buckets of at most `bucket_bytes` (a larger tensor alone), counted into `stats` (with
    `digests`, each tensor's digest too): what a sync loads and a push sends, one bucket at a time."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in hf_tensors(model, arch, par, dtype, stats):
        if digests:
            stats.digests[name] = digest(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
        stats.bytes += nbytes
        stats.tensors += 1
    if bucket:
        yield bucket


def _load(engine: RolloutEngine, bucket: list[tuple[str, torch.Tensor]], stats: SyncStats) -> None:
    start = time.perf_counter()
    _agree(lambda: engine.load_weights(bucket), engine, f"bucket {stats.buckets + 1}")
    stats.load_s += time.perf_counter() - start
    stats.buckets += 1


def _agree(step, engine: RolloutEngine, what: str) -> None:
    """Run `step`; raise on every rank if it failed on any."""
    error: BaseException | None = None
    try:
        step()
    except Exception as err:
        error = err
    # on the platform's device: NCCL and HCCL reduce only tensors on theirs
    ok = torch.tensor([0.0 if error else 1.0], device=get_platform().device())
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() < 1.0:
        engine.abort_weight_update()
        cause = f": {error}" if error else " on another rank"
        raise WeightSyncError(f"weight sync failed at {what}{cause}; the engine holds half-updated weights and "
                              f"refuses to generate until the next complete sync, so nothing is generated with "
                              f"them.") from error


def hf_tensors(model: torch.nn.Module, arch: ModelArch, par: ParallelConfig, dtype: torch.dtype,
               stats: SyncStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the model, on every rank, in the same order (collective over the actor's
    ranks); gather and convert times are added to `stats`."""
    stats = stats or SyncStats()
    params = lora.merged_parameters(model)  # a LoRA model's engines take W + (alpha / r)·B·A
    param_dtype = next(iter(params.values())).dtype
    device = next(iter(params.values())).device
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank() if par.ep > 1 else 0
    shapes = hfm.hf_param_shapes(arch)
    for stage in range(par.pp):
        mine = sharding.stage_names(arch, par, stage, ep_rank)
        for name in sharding.stage_names(arch, par, stage, ep_rank=None):
            start = time.perf_counter()
            pieces = tp_layout.hf_pieces(arch, par.tp, [name])
            replicated = all(rank == 0 for entries in pieces.values() for _, rank, _ in entries)
            held = params[mine[name]].detach() if stage == pp_rank and name in mine else None
            shape = sharding.shard_shape(name, arch, par.tp)
            owner = _expert_owner(name, arch, par)
            shards = _shards(held, shape, 1 if replicated else par.tp, stage, par,
                             hfm.tensor_dtype(name, param_dtype), device, owner, stage == pp_rank)
            stats.gather_s += time.perf_counter() - start
            for hf_name, hf_pieces in pieces.items():
                start = time.perf_counter()
                out = torch.empty(shapes[hf_name], dtype=hfm.tensor_dtype(hf_name, dtype), device=device)
                tensor = tp_layout.fill_hf_tensor(out, hf_pieces, {name: shards}, par.tp)
                stats.convert_s += time.perf_counter() - start
                yield hf_name, tensor


def _expert_owner(name: str, arch: ModelArch, par: ParallelConfig) -> int | None:
    """The expert-parallel rank holding a routed expert's tensor (None: every EP rank holds the tensor)."""
    expert = sharding.expert_of(name)
    return None if expert is None or par.ep == 1 else expert // (arch.num_experts // par.ep)


def _shards(held: torch.Tensor | None, shape: tuple[int, ...], count: int, stage: int, par: ParallelConfig,
            dtype: torch.dtype, device: torch.device, owner: int | None = None,
            in_stage: bool = False) -> list[torch.Tensor]:
    """The TP shards of one Megatron tensor, on every rank: gathered inside the holding stage's TP
    group (only TP rank 0's, `count` 1, for a tensor every TP rank holds whole), for an expert's
    tensor broadcast from its `owner` over the stage's expert-parallel group, then broadcast
    over the pipeline group."""
    flat = torch.empty((count, *shape), dtype=dtype, device=device)
    if held is not None:
        if count == 1:
            flat[0].copy_(held)
        else:
            dist.all_gather(list(flat.unbind(0)), held.contiguous(),
                            group=parallel_state.get_tensor_model_parallel_group())
    if owner is not None and in_stage:
        group = parallel_state.get_expert_model_parallel_group()
        dist.broadcast(flat, src=dist.get_process_group_ranks(group)[owner], group=group)
    if par.pp > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        dist.broadcast(flat, src=dist.get_process_group_ranks(group)[stage], group=group)
    return list(flat.unbind(0))


def digest(tensor: torch.Tensor) -> str:
    """A digest of the tensor's exact bytes (dtype and shape included)."""
    data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy()
    return hashlib.blake2b(data.tobytes() + f"{tensor.dtype}{tuple(tensor.shape)}".encode(), digest_size=8).hexdigest()
