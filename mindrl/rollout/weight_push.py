"""Pushing the actor's weights to rollout engines on ranks of their own (asynchronous RL's placement).

The push group spans the actor's ranks (0 … A−1) and the rollout ranks (A …): a gloo process group built directly
over a store of its own, so neither side's default process group (the actor's Megatron world, the engines' own
world) is touched or has to know about the other. Every actor rank walks `hf_tensors` (a collective among the actor's
ranks: the TP/PP gather), but only actor rank 0, the root, sends, point to point to each rollout rank (a
broadcast would make every actor rank receive what it already has): per bucket of at most `bucket_bytes`, in the
engine's order and dtype, a manifest (names, shapes, dtypes, the policy version; a length-prefixed uint8 tensor) and
then the bucket's bytes as one flat buffer. Each rollout rank cuts the buffer into views and loads them into its
engine; after the last bucket every member of the group agrees whether every engine loaded everything, so both
sides raise the same WeightSyncError when one failed, and a failed engine refuses to generate until the next
complete push (as `sync_weights` leaves a colocated engine).

Tensors cross on the host: on GPU or NPU the same code copies each bucket to the CPU and moves it through gloo.
A push group over NCCL / HCCL, device to device, is future work.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mindrl.config import ModelArch, ParallelConfig
from mindrl.rollout.base import RolloutEngine
from mindrl.rollout.weight_sync import SyncStats, WeightSyncError, hf_buckets

ROOT = 0
#: dtypes a manifest can name
_DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16)}
#: each tensor starts this many bytes into the buffer, so any dtype's view of it is aligned
_ALIGN = 16


class PushGroup:
    """This process's membership of the push group: `rank` of `world`, the first `actors` of them the actor's
    ranks (its rank 0 the root), the rest rollout ranks."""

    def __init__(self, host: str, port: int, world: int, rank: int, actors: int, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world, self.actors = rank, world, actors
        # a client of the store someone serves (RankProcess.serve_push); the group's keys under a prefix of their own
        self._store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
        self._group = dist.ProcessGroupGloo(dist.PrefixStore("mindrl-push/", self._store), rank, world, timeout)

    def fan_out(self, tensor: torch.Tensor) -> None:
        """`tensor` from the root into every rollout rank's `tensor`; the other actor ranks take no part."""
        if self.rank == ROOT:
            for sent in [self._group.send([tensor], rank, 0) for rank in range(self.actors, self.world)]:
                sent.wait()
        elif self.rank >= self.actors:
            self._group.recv([tensor], ROOT, 0).wait()

    def all_ok(self, ok: bool) -> bool:
        """Whether every member is ok."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._group.allreduce([flag], options).wait()
        return bool(flag.item())

    def send_manifest(self, manifest: dict) -> None:
        data = torch.frombuffer(bytearray(json.dumps(manifest).encode()), dtype=torch.uint8)
        self.fan_out(torch.tensor([data.numel()], dtype=torch.int64))
        self.fan_out(data)

    def receive_manifest(self) -> dict:
        length = torch.zeros(1, dtype=torch.int64)
        self.fan_out(length)
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        self.fan_out(data)
        return json.loads(data.numpy().tobytes().decode())


@dataclass
class PushStats(SyncStats):
    """A push's time and bytes on the actor's side: what SyncStats counts, with the sending in `send_s`."""

    send_s: float = 0.0

    def seconds(self) -> float:
        return super().seconds() + self.send_s

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "sync/send_seconds": self.send_s}


def push_weights(group: PushGroup, model: torch.nn.Module, arch: ModelArch, par: ParallelConfig,
                 dtype: torch.dtype, bucket_bytes: int, version: int) -> PushStats:
    """Send the actor's weights (this rank's stage `model`) to the rollout ranks, tagged with policy `version`;
    called on every actor rank at once, with `receive_weights` on every rollout rank."""
    stats = PushStats()
    try:
        for bucket in hf_buckets(model, arch, par, dtype, bucket_bytes, stats):
            _send(group, bucket, version, stats)
        if group.rank == ROOT:
            group.send_manifest({"version": version, "done": True})
    except BaseException:
        if group.rank == ROOT:  # the receivers would otherwise wait for the next bucket until the timeout
            group.send_manifest({"version": version, "aborted": True})
        raise
    if not group.all_ok(True):
        raise WeightSyncError(f"pushing weights version {version} failed on a rollout rank; its engine refuses to "
                              f"generate until the next complete push.")
    return stats


def _send(group: PushGroup, bucket: list[tuple[str, torch.Tensor]], version: int, stats: PushStats) -> None:
    stats.buckets += 1
    if group.rank != ROOT:
        return
    start = time.perf_counter()
    offsets, end = [], 0
    for _, tensor in bucket:
        offsets.append(end)
        end += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    flat = torch.empty(end, dtype=torch.uint8)
    for (_, tensor), offset in zip(bucket, offsets, strict=True):
        raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        flat[offset:offset + raw.numel()].copy_(raw)
    group.send_manifest({"version": version, "names": [name for name, _ in bucket], "offsets": offsets,
                         "shapes": [list(tensor.shape) for _, tensor in bucket],
                         "dtypes": [str(tensor.dtype) for _, tensor in bucket], "bytes": end})
    group.fan_out(flat)
    stats.send_s += time.perf_counter() - start


def receive_weights(group: PushGroup, engine: RolloutEngine) -> tuple[int, dict[str, float]]:
    """Load a push into `engine` (every rollout rank at once, with `push_weights` on the actor's ranks): the
    version pushed and this rank's metrics. A failure leaves the engine refusing to generate."""
    start = time.perf_counter()
    load_s, error = 0.0, None
    while True:
        manifest = group.receive_manifest()
        if manifest.get("aborted"):
            engine.abort_weight_update()
            raise WeightSyncError(f"the actor's ranks failed part way through pushing weights version "
                                  f"{manifest['version']} (their error says why); the engine refuses to generate "
                                  f"until the next complete push.")
        if manifest.get("done"):
            break
        flat = torch.empty(manifest["bytes"], dtype=torch.uint8)
        group.fan_out(flat)
        if error is None:  # after a failure the buckets are still taken, so the root is not left waiting
            loaded = time.perf_counter()
            try:
                engine.load_weights(_views(flat, manifest))
            except Exception as err:
                error = err
            load_s += time.perf_counter() - loaded
    if error is None:
        loaded = time.perf_counter()
        try:
            engine.finish_weight_update()
        except Exception as err:
            error = err
        load_s += time.perf_counter() - loaded
    if error is not None:
        engine.abort_weight_update()
    if not group.all_ok(error is None):
        if error is None:
            engine.abort_weight_update()  # another rollout rank's engine failed: the rollout ranks stay alike
        cause = f": {error}" if error else " on another rollout rank"
        raise WeightSyncError(f"loading pushed weights version {manifest['version']} failed{cause}; the engine "
                              f"refuses to generate until the next complete push.") from error
    return manifest["version"], {"sync/receive_seconds": time.perf_counter() - start, "sync/load_seconds": load_s}


def _views(flat: torch.Tensor, manifest: dict) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, offset, shape, dtype in zip(manifest["names"], manifest["offsets"], manifest["shapes"],
                                          manifest["dtypes"], strict=True):
        dtype = _DTYPES[dtype]
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        out.append((name, flat[offset:offset + nbytes].view(dtype).view(shape)))
    return out
