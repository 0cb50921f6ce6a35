"""Let megatron-core 0.16 run on CPU with the gloo backend.

megatron-core assumes a CUDA device in a few dozen places: `torch.cuda.current_device()`
as a tensor's device, `device="cuda"` in buffers and masks, `.cuda()` on scalars,
CUDA events/streams/synchronize in the pipeline schedules, the CUDA RNG state in its
model-parallel RNG tracker, and `param.type() == 'torch.cuda.FloatTensor'` in the
optimizers. On CPU the host *is* the device, so each patch maps the CUDA notion onto
its CPU twin rather than skipping it; the numbers Megatron computes stay the same.

Only mindrl.platform.cpu applies these, only once, and only on a CPU run.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class CudaToCpuMode(TorchFunctionMode):
    """Runs every torch call with CUDA devices replaced by the CPU.

    Covers `device="cuda"` / `device=torch.device("cuda")` keywords, `x.to("cuda")`,
    `x.cuda()`, and `x.type()` (which Megatron compares with CUDA tensor type names).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _TYPE_NAMES.get(args[0].dtype) or func(*args)
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _CpuEvent:
    """Stands in for torch.cuda.Event: CPU work is already done when Python moves on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._time = 0.0

    def record(self, stream: Any = None) -> None:
        import time

        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _CpuEvent) -> float:
        return (end._time - self._time) * 1000.0


class _CpuStream:
    """Stands in for torch.cuda.Stream: CPU ops run in issue order on one stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event or _CpuEvent()

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _CpuStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _cpu_stream_context(stream: Any = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext(stream)


def patch_cuda_device_queries() -> None:
    """`torch.cuda.current_device()` is used as a tensor device: make it the CPU."""
    torch.cuda.current_device = lambda: torch.device("cpu")


def patch_cuda_sync_primitives() -> None:
    """Events, streams and synchronize in schedules, p2p and timers become CPU no-ops."""
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Event = _CpuEvent
    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda device=None: _CpuStream()
    torch.cuda.default_stream = lambda device=None: _CpuStream()
    torch.cuda.stream = _cpu_stream_context


def patch_cuda_rng() -> None:
    """Megatron's model-parallel RNG tracker forks the *device* generator: on CPU that is
    the CPU generator, so dropout and init stay reproducible and per-TP-rank distinct."""
    from megatron.core.tensor_parallel import random as mp_random

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = torch.manual_seed
    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = set_state


def enter_device_mode() -> None:
    """Turn CudaToCpuMode on for the calling thread (modes are thread-local)."""
    if not getattr(_state, "mode_entered", False):
        CudaToCpuMode().__enter__()
        _state.mode_entered = True


def device_mode_suspended() -> contextlib.AbstractContextManager:
    """CudaToCpuMode off until the block ends, where it is this thread's innermost torch function mode."""
    if isinstance(torch.overrides._get_current_function_mode(), CudaToCpuMode):
        return torch.overrides._pop_mode_temporarily()
    return contextlib.nullcontext()


def patch_moe_host_copies() -> None:
    """The alltoall token dispatcher copies its split sizes "to the host" as numpy arrays, but only from a
    CUDA tensor; on CPU they stayed tensors, which gloo's all_to_all refuses as split sizes. Here the host
    copy of a host tensor is the same numpy view."""
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def patch_uneven_all_gather() -> None:
    """megatron-core gathers expert tokens of uneven counts per rank (`all_gather` into differently sized
    outputs), which NCCL and HCCL do and gloo refuses. On gloo each rank's piece is padded to the largest,
    gathered, and cut back: the same result."""
    import torch.distributed as dist

    gather = dist.all_gather

    def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
                   async_op: bool = False) -> Any:
        if all(t.shape == tensor.shape for t in tensor_list) or dist.get_backend(group) != "gloo":
            return gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[:tensor.shape[0]] = tensor
        pieces = [torch.empty_like(padded) for _ in tensor_list]
        gather(pieces, padded, group=group)
        for out, piece in zip(tensor_list, pieces, strict=True):
            out.copy_(piece[:out.shape[0]])
        return None

    dist.all_gather = all_gather


PATCHES: tuple[Callable[[], None], ...] = (
    patch_cuda_device_queries,
    patch_cuda_sync_primitives,
    patch_cuda_rng,
    patch_moe_host_copies,
    patch_uneven_all_gather,
)

_state = threading.local()
_applied = False
_lock = threading.Lock()


def apply() -> None:
    """Apply every patch once per process and the device mode once per thread."""
    global _applied
    with _lock:
        if not _applied:
            for patch in PATCHES:
                patch()
            # Advice on CUDA connection queues for TP's overlapped all-reduce: nothing to act on when
            # the host is the device (on a GPU it stays visible).
            warnings.filterwarnings("ignore", message="When using async grad allreduce it is recommended to set "
                                    "the environment variable CUDA_DEVICE_MAX_CONNECTIONS", category=UserWarning,
                                    module=r"megatron\.core\.tensor_parallel\.layers$")
            _applied = True
    enter_device_mode()
