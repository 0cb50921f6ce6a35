"""Run a function on N local ranks that share one process group.

Used by the tests, the benchmarks and the CPU demo: each rank is a fresh process
(spawn, so nothing of the parent's threads or CUDA state is inherited) that joins a
loopback process group, runs `fn(rank, *args)` and sends back what it returns.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mindrl.distributed import destroy, init_distributed


def rendezvous_store(world_size: int, timeout_s: float = 600.0, host: str = "127.0.0.1") -> dist.TCPStore:
    """A rendezvous store served from this process on a port the OS picks (on loopback by default).

    The port is bound from the moment it is chosen until the store is dropped, so parallel
    launches cannot race for it (picking a free port and binding it later can).
    """
    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, device: str | None,
               args: tuple, results: mp.Queue) -> None:
    try:
        from mindrl.platform import get_platform

        if device is not None:
            # what `fn` asks of get_platform() without a device must be this rank's device, not the one the
            # parent's environment names (a CUDA rank once switched itself to the CPU platform and its patches)
            os.environ["MINDRL_DEVICE"] = device
        init_distributed(rank, world_size, master_port=port, platform=get_platform(device), store_is_served=True)
        value = fn(rank, *args)
        # Plain bytes: torch's default queue pickling passes tensors as shared-memory file
        # descriptors, which vanish when this process exits before the parent reads them.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, device: str | None = None,
              timeout_s: float = 600.0) -> list[Any]:
    """`fn(rank, *args)` on `world_size` processes; returns their results by rank.

    `fn` must be importable by name (a module-level function). If any rank fails, the
    others are stopped and a RuntimeError carries the failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = rendezvous_store(world_size, timeout_s)
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, world_size, store.port, device, args, results),
                         daemon=True) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    try:
        while len(outputs) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise RuntimeError(f"ranks {sorted(set(range(world_size)) - set(outputs))} gave no "
                                   f"result within {timeout_s:.0f} s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        if len(outputs) < world_size:  # a rank failed: the others may wait in a collective forever
            for proc in procs:
                proc.terminate()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [outputs[rank] for rank in range(world_size)]
