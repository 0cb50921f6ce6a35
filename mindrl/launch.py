"""Run a function on N local ranks that share one process group.

Used by the tests, the benchmarks and cli/evaluate.py: each rank is a new process that joins a
loopback process group, runs `fn(rank, *args)` and sends back what it returns.

CPU ranks fork from a server process of their own that has imported torch, megatron-core,
transformers and vLLM's engine once (multiprocessing's forkserver, with its own preload): a spawned
rank spent 3–6 s importing them, and an engine's first start 2.5 s more, on every launch. The server
itself never runs rank code, so a rank still starts with nothing of an earlier one: no process group,
no Megatron state, fresh random generators (each forked rank reseeds them, as a spawned one starts)
and the parent's environment of the moment; and it ends as its own interpreter would. The server is
restarted when the parent's environment differs from the one it imported under, since libraries read
some variables at import (OpenMP's thread count, vLLM's settings). GPU and NPU ranks are spawned:
their runtimes are not fork-safe once initialised, and a library that probes the device at import
would initialise it in the server.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import forkserver, popen_forkserver, resource_tracker, spawn
from multiprocessing.context import ForkServerProcess, reduction, set_spawning_popen
from multiprocessing.util import Finalize, close_fds
from typing import Any

import torch
import torch.distributed as dist

from mindrl.console import run_exit_handlers
from mindrl.distributed import destroy, init_distributed
from mindrl.platform import detect, requested

#: what the rank server imports before it forks anyone: the heavy libraries the ranks need, vLLM's engine
#: and its model for the tiny Qwen2 models included (a name that is not installed is skipped)
PRELOAD = ("torch", "torch.distributed", "transformers", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.pipeline_parallel",
           "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.worker.cpu_worker",
           "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.qwen2")


#: variables that change between launches and that no library reads at import: pytest names the running test,
#: a run's log is named for its processes (a rank's output follows the launcher's file descriptors anyway)
_VOLATILE = ("PYTEST_CURRENT_TEST", "MINDRL_RUN_LOG")


def _import_environment() -> dict[str, str]:
    """The environment the server's imports could have read: a launch under another one restarts it."""
    return {key: value for key, value in os.environ.items() if key not in _VOLATILE}


class _RankServer(forkserver.ForkServer):
    """A forkserver of the ranks' own, apart from the stdlib's shared one (the verifiers' pool preloads
    other modules into that one, and whichever starts first would decide for both)."""

    def __init__(self, environment: dict[str, str]) -> None:
        super().__init__()
        self.environment = environment
        self.set_forkserver_preload(list(PRELOAD))

    def _stop(self) -> None:
        """The server ends once every holder of its 'alive' pipe has closed it; a process some rank started and
        left running could hold it, and the stdlib's stop would then wait for that process forever."""
        if self._forkserver_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._forkserver_pid, signal.SIGTERM)
        super()._stop()


_server: _RankServer | None = None
_server_lock = threading.Lock()


def _rank_server() -> _RankServer:
    """The running server, restarted first if the environment has changed since it imported its libraries."""
    global _server
    with _server_lock:
        environment = _import_environment()
        if _server is None or _server.environment != environment:
            if _server is not None:
                _server._stop()
            _server = _RankServer(environment)
        return _server


class _RankPopen(popen_forkserver.Popen):
    """The stdlib's forkserver start (CPython 3.11's `popen_forkserver.Popen._launch`), asking the rank server
    for the fork and handing the rank this process's stdout and stderr: the server's are those of whenever it
    started, and a spawned rank would write where its launcher's descriptors point now (a run's log)."""

    def _launch(self, process_obj: Any) -> None:
        assert _server is not None, "run_ranks starts the rank server before its ranks"
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self._fds.extend((1, 2))  # the last two the rank inherits, whatever Python's streams are in this process
        self.sentinel, w = _server.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)
        self.finalizer = Finalize(self, close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _RankProcess(ForkServerProcess):
    """A process started by `_RankPopen`."""

    @staticmethod
    def _Popen(process_obj: Any) -> _RankPopen:
        return _RankPopen(process_obj)


def _fresh_process_state(environment: dict[str, str]) -> None:
    """What a spawned process would start with, in a process forked from the rank server."""
    inherited = forkserver.get_inherited_fds()
    for target, fd in ((1, inherited[-2]), (2, inherited[-1])):
        os.dup2(fd, target)
        os.close(fd)
    # a program the rank starts must not hold the server's liveness pipe or the resource tracker's
    os.set_inheritable(forkserver._forkserver._forkserver_alive_fd, False)
    os.set_inheritable(resource_tracker._resource_tracker._fd, False)
    os.environ.clear()
    os.environ.update(environment)
    # a new process draws its own seeds; a fork would share the server's (Python's `random` reseeds itself)
    torch.seed()
    import numpy as np

    np.random.seed()


def rendezvous_store(world_size: int, timeout_s: float = 600.0, host: str = "127.0.0.1") -> dist.TCPStore:
    """A rendezvous store served from this process on a port the OS picks (on loopback by default).

    The port is bound from the moment it is chosen until the store is dropped, so parallel
    launches cannot race for it (picking a free port and binding it later can).
    """
    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, device: str | None,
               packed_args: bytes, results: mp.Queue, environment: dict[str, str] | None) -> None:
    """One rank; `environment` is its launch's, for a rank forked from the rank server (None: spawned)."""
    try:
        if environment is not None:
            _fresh_process_state(environment)
        # on the host: a device tensor would bind this rank to the parent's device before it picks its own
        args = torch.load(io.BytesIO(packed_args), weights_only=False, map_location="cpu")
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
        if environment is not None:
            _exit_as_a_spawned_process(results)


def _exit_as_a_spawned_process(results: mp.Queue) -> None:
    """End the way an interpreter of its own ends. A forked rank leaves by os._exit, which skips Python's atexit
    handlers and the C++ libraries' exit code: vLLM unlinks its CPU engines' shared-memory segments there, and a
    segment left behind makes the next engine of the same name fail ('create shm in SHMManager failed')."""
    results.close()
    results.join_thread()  # the result is in the pipe before anything else ends
    run_exit_handlers()
    ctypes.PyDLL(None).exit(0)  # holding the GIL: no Python thread runs while the C++ libraries tear down


def _failures(rank: int, trace: str, world_size: int, results: mp.Queue, grace_s: float = 2.0) -> str:
    """Every rank's failure that arrives within `grace_s` of the first, in order of arrival: a rank's report can
    reach the queue after a peer's report of what it caused (a link closed under a collective), so the first one
    alone may name a consequence rather than the cause."""
    failures = [(rank, trace)]
    deadline = time.monotonic() + grace_s
    while len(failures) < world_size and (left := deadline - time.monotonic()) > 0:
        try:
            other, ok, payload = results.get(timeout=left)
        except queue.Empty:
            break
        if not ok:
            failures.append((other, payload))
    return "\n".join(f"rank {r} of {world_size} failed:\n{text}" for r, text in failures)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, device: str | None = None,
              timeout_s: float = 600.0) -> list[Any]:
    """`fn(rank, *args)` on `world_size` processes; returns their results by rank.

    `fn` must be importable by name (a module-level function). If any rank fails, the
    others are stopped and a RuntimeError carries the traceback of each rank that failed
    within 2 s of the first, first come first.
    """
    name = requested(device)
    forked = (detect() if name == "auto" else name) == "cpu"
    if forked:
        _rank_server()  # once for the launch: all its ranks fork from one server
    ctx = mp.get_context("forkserver" if forked else "spawn")
    process = _RankProcess if forked else ctx.Process
    results = ctx.Queue()
    store = rendezvous_store(world_size, timeout_s)
    environment = dict(os.environ) if forked else None
    # as plain bytes: pickled by multiprocessing, each tensor would travel as a file descriptor, and a start
    # carries at most a few hundred of them
    packed = io.BytesIO()
    torch.save(args, packed)
    procs = [process(target=_rank_main, args=(fn, rank, world_size, store.port, device, packed.getvalue(), results,
                                              environment), daemon=True) for rank in range(world_size)]
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
                raise RuntimeError(_failures(rank, value, world_size, results))
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
