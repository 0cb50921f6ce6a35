"""Training checkpoints in megatron-core's distributed format (Megatron-LM's `--ckpt-format torch_dist`).

    ROOT/latest_checkpointed_iteration.txt       the last complete iteration (written last, as for `torch`)
    ROOT/iter_0000100/
        metadata.json                            {"sharded_backend": "torch_dist", ...}: the format's mark
        .metadata, __R_T.distcp                  torch.distributed.checkpoint's index and each rank's shards
        common.pt                                what every rank holds alike: args, iteration, LR schedule,
                                                 the optimizer's hyper-parameters, the trainer's extra state

Every tensor is stored once, under its whole-model name and shape (`decoder.layers.7.mlp.linear_fc1.weight`
of all TP ranks joined), with the optimizer's fp32 master weights and Adam moments in the same model space
(megatron-core's `fully_reshardable` distributed-optimizer format): a checkpoint saved at one TP × PP × EP × DP
layout loads at any other, optimizer state included. Each rank writes the shards it holds (replicas spread over
the data-parallel ranks), so a save is parallel over the job.

The writes run in threads of the rank, not in processes forked from it as megatron-core's own writer does (a
rank forked from a daemon or a device runtime cannot have children); with `async_save` they run while training
goes on, from a copy of the state taken when the save starts. A save is published (renamed into place, then the
tracker) only once every rank's writes have finished (`PendingSave.finish`): a killed job leaves the previous
iteration as the one a resume loads. RNG states are saved per rank and restored where the layout is the saved
one; at another layout they cannot be matched to ranks and the generators keep their seeded state (said once).
"""

from __future__ import annotations

import io
import os
import queue
import shutil
import threading
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint.filesystem import SerializationFormat, _write_item
from torch.distributed.checkpoint.utils import _get_failure_dict

from mindrl.checkpoint import files, publish, rng
from mindrl.checkpoint import megatron as mg
from mindrl.checkpoint.files import FORMAT, common_state
from mindrl.checkpoint.training import (
    Resumed,
    TrainState,
    apply_loaded_schedule,
    check_plain,
    fresh_optimizer,
    initial_moments,
    optimizer_tensors,
    optimizers,
)
from mindrl.config import ConfigError, ModelArch, ParallelConfig
from mindrl.console import say
from mindrl.platform import get_platform

#: the distributed optimizer's state in the model's space, named as the parameters are (not by the optimizer that
#: holds them): it reshards over TP, PP, EP and DP
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
_WRITE_THREADS = 2

def layout(state: TrainState) -> dict[str, int]:
    """The ranks' arrangement a checkpoint's RNG states belong to."""
    return {"tp": state.par.tp, "pp": state.par.pp, "ep": state.par.ep, "dp": state.ranks[3], "cp": state.par.cp,
            "world": dist.get_world_size()}


def _local_data_parallel_group() -> Any:
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _replicas(state: TrainState) -> int:
    """Ranks holding the same weights, over which saves and loads are spread: the data- and context-parallel
    ones."""
    return state.ranks[3] * state.par.cp


class _ThreadedSave(TorchDistSaveShardedStrategy):
    """megatron-core's torch_dist save with the files written by threads of this rank (module docstring), and a
    finalize whose failures every rank learns of."""

    def __init__(self, live: set[int]) -> None:
        super().__init__(FORMAT, 1, thread_count=_WRITE_THREADS)
        self.live = live
        # megatron-core's writer asks for a results queue of a spawned manager process; the threads use their own
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = queue.Queue()

    def _get_save_and_finalize_callbacks(self, writer: Any, save_state_dict_ret: Any) -> AsyncRequest:
        writer.results_queue = queue.Queue()
        buckets = [(path, key, (data, [(item, _host(t, self.live)) for item, t in tensors]))
                   for path, key, (data, tensors) in writer.write_buckets or []]
        transforms = [writer.transforms] if hasattr(writer, "transforms") else []
        return AsyncRequest(partial(_write_buckets, transforms, buckets, writer.results_queue), (),
                            [partial(_finalize, *save_state_dict_ret)])


def _live_storages(state: TrainState) -> set[int]:
    """The storages training goes on changing: the parameters, master weights and Adam moments."""
    tensors = [*state.model.parameters(), *optimizer_tensors(state.optimizer)]
    return {t.untyped_storage().data_ptr() for t in tensors}


def _host(tensor: torch.Tensor, live: set[int]) -> torch.Tensor:
    """The bytes to write, on the host: copied where they live on a device, or where training changes them
    before a background write does (megatron-core's planner already copied the views into its buffers)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor.to("cpu")
    return tensor.clone() if tensor.untyped_storage().data_ptr() in live else tensor


def _write_buckets(transforms: list, buckets: list, results: queue.Queue) -> None:
    """Each bucket (one .distcp file) in its own thread; the write results, or the first error, for the finalize
    (which every rank then learns of)."""
    try:
        done: queue.Queue = queue.Queue()
        threads = [threading.Thread(target=_write_one, args=(transforms, index, bucket, done), daemon=True)
                   for index, bucket in enumerate(buckets)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        out: dict[int, Any] = {}
        while not done.empty():
            index, value = done.get_nowait()
            if isinstance(value, BaseException):
                raise value
            out[index] = value
        if len(out) != len(buckets):
            raise RuntimeError(f"{len(buckets) - len(out)} of {len(buckets)} writer threads ended without a result")
        results.put(out)
    except Exception as err:
        results.put(err)


class _RecordingFile(io.FileIO):
    """A file whose failed write is kept: torch.save reports one as an assertion of its zip writer ("unexpected
    pos …"), which loses the OS error (a full disk, a file too large) a user has to act on."""

    error: OSError | None = None

    def write(self, data: Any) -> int | None:
        try:
            return super().write(data)
        except OSError as err:
            self.error = OSError(err.errno, err.strerror, self.name)
            raise


def _write_one(transforms: list, index: int, bucket: Any, done: queue.Queue) -> None:
    """One .distcp file as megatron-core's writer lays it out (torch.distributed.checkpoint's items, each
    torch.save'd), flushed to the disk."""
    path, storage_key, (bytes_data, tensor_data) = bucket
    raw = None
    try:
        raw = _RecordingFile(path, "wb")
        with io.BufferedWriter(raw) as stream:
            written = [_write_item(*transforms, stream, data, item, storage_key, SerializationFormat.TORCH_SAVE)
                       for item, data in [*bytes_data, *tensor_data]]
            stream.flush()
            os.fsync(raw.fileno())
        done.put((index, written))
    except Exception as err:
        done.put((index, raw.error if raw is not None and raw.error is not None else err))


def _finalize(writer: Any, metadata: Any, wrapper: Any) -> None:
    """megatron-core's finalize: every rank's write results gathered, the index written by the coordinator. A
    failure is raised on the coordinator after the gather, where publish.together shares it with every rank."""
    results = wrapper.gather_object(writer.retrieve_write_results())
    if wrapper.is_coordinator:
        failures = _get_failure_dict(results)
        if failures:
            rank, failure = next(iter(failures.items()))
            cause = failure[0] if isinstance(failure, tuple) else failure
            raise RuntimeError(f"the writes of rank {rank} failed ({cause})")
        writer.finish(metadata, results)


def _start(sharded: dict[str, Any], folder: Path, live: set[int], dp_size: int, what: str, after: str
           ) -> AsyncRequest:
    """The collective part of a save: the common state written by rank 0, the shards planned over the ranks (and
    their replicas spread over the data-parallel ranks); the writes are the returned request's."""
    sharded_part, common = save_preprocess(sharded, validate_access_integrity=True)
    publish.together(lambda: TorchCommonSaveStrategy(FORMAT, 1).save_common(common, folder),
                     dist.get_rank() == 0, what, after)
    strategy: Any = _ThreadedSave(live)
    if dp_size > 1:
        strategy = FullyParallelSaveStrategyWrapper(strategy, _local_data_parallel_group())
    return strategy.async_save(sharded_part, folder)


def _complete(request: AsyncRequest, folder: Path, what: str, after: str) -> None:
    """After the writes: the index and megatron-core's format file, each step's failure shared by every rank."""
    for fn in request.finalize_fns:
        publish.together(fn, True, what, after)
    publish.together(lambda: save_config(CheckpointingConfig(FORMAT, 1), folder), dist.get_rank() == 0, what,
                     after)


class PendingSave:
    """An iteration being written: published by `finish` once every rank's writes are done."""

    def __init__(self, request: AsyncRequest, root: Path, tmp: Path, iteration: int, what: str) -> None:
        self.request, self.root, self.tmp, self.iteration, self.what = request, root, tmp, iteration, what
        self.thread = threading.Thread(target=request.async_fn, daemon=True, name=f"save-{iteration}")
        self.thread.start()

    def finish(self, wait: bool) -> bool:
        """Publish the iteration if every rank's writes are done (waiting for them where `wait`); every rank
        calls it at the same point. Returns whether it was published; a failure is SaveFailed on every rank,
        with the iteration's files removed."""
        if wait:
            self.thread.join()
        done = torch.tensor([float(not self.thread.is_alive())], device=get_platform().device())
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if not done.item():
            return False
        after = _after(self.root)
        try:
            _complete(self.request, self.tmp, self.what, after)
        except publish.SaveFailed:
            if dist.get_rank() == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        publish.together(lambda: publish.publish(self.root, self.tmp, self.iteration), dist.get_rank() == 0,
                         self.what, after)
        return True


def _after(root: Path) -> str:
    return f"{publish.what_is_kept(root)} — free space or fix the folder, then resume with load={root}"


def save(state: TrainState, root: str | Path, iteration: int, extra: dict[str, Any] | None = None,
         async_save: bool = False) -> PendingSave:
    """Every rank calls this; the iteration is published by the returned save's `finish` (at once unless
    `async_save`, where the writes go on in threads from a copy of what training changes)."""
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"checkpoint iteration must be a non-negative integer, got {iteration!r}.")
    extra = dict(extra or {})
    check_plain(extra)
    root = Path(root)
    tmp = publish.tmp_dir(root, iteration)
    what, after = f"saving checkpoint iteration {iteration} to {root}", _after(root)
    publish.together(lambda: publish.prepare(root, tmp), dist.get_rank() == 0, what, after)
    try:
        with initial_moments(state.optimizer, keep=False) as stepped:
            request = _start(_sharded_state(state, extra, stepped, iteration), tmp,
                             _live_storages(state) if async_save else set(), _replicas(state), what, after)
    except publish.SaveFailed:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    pending = PendingSave(request, root, tmp, iteration, what)
    if not async_save:
        pending.finish(wait=True)
    return pending


def save_weights(model: torch.nn.Module, folder: str | Path, common: dict[str, Any]) -> None:
    """A model alone (starting weights, no optimizer) into an empty torch_dist folder, with `common` beside it;
    every rank calls it."""
    folder = Path(folder)
    what = f"saving weights to {folder}"
    request = _start({"model": model.sharded_state_dict(), **common}, folder, set(), 1, what, "nothing was kept")
    request.async_fn()
    _complete(request, folder, what, "nothing was kept")


def _sharded_state(state: TrainState, extra: dict[str, Any], stepped: bool, iteration: int) -> dict[str, Any]:
    model = _model_state(state)
    args = mg.checkpoint_args(state.arch, state.par, state.model.config.params_dtype,
                              data_parallel_size=state.ranks[3], use_distributed_optimizer=True)
    return {
        "model": model,
        "optimizer": state.optimizer.sharded_state_dict(model, metadata=OPTIMIZER_SHARDING),
        "rng_state": _rng_object(rng.capture()),
        "iteration": iteration,
        "checkpoint_version": mg.CHECKPOINT_VERSION,
        "args": args,
        "optimizer_stepped": stepped,
        "opt_param_scheduler": state.scheduler.state_dict(),
        "actor_updates": state.updates,
        "extra": extra,
        "mindrl_layout": layout(state),
        "lora": {"r": state.lora.r, "alpha": state.lora.alpha, "target_modules": list(state.lora.target_modules),
                 "adapters_only": state.lora.ckpt_filter, "base_digest": None,
                 "base_fingerprint": base_fingerprint(state.model) if state.lora.ckpt_filter else None}
        if state.lora.enabled else None,
    }


def _model_state(state: TrainState) -> dict[str, Any]:
    """The model's sharded state dict; an adapters-only LoRA run's holds what trains (its base is the run's
    initial weights, checked by base_fingerprint)."""
    model = state.model.sharded_state_dict()
    if not state.lora.ckpt_filter:
        return model
    return {name: value for name, value in model.items() if getattr(value.data, "requires_grad", False)}


def base_fingerprint(model: torch.nn.Module) -> list[list]:
    """[key, n, Σx, Σx²] of every frozen whole-model tensor, summed in float64 over the ranks' shards: the same
    at every layout (to the sums' rounding), where a per-rank digest of the base is not. Every rank calls it."""
    sums: dict[str, list[float]] = {}
    sharded = {name: value for name, value in model.sharded_state_dict().items()
               if not getattr(value.data, "requires_grad", True)}
    apply_factories(sharded)
    for value in nested_values(sharded):
        replica = value.replica_id if isinstance(value.replica_id, tuple) else (value.replica_id,)
        if not isinstance(value, ShardedTensor) or any(replica):
            continue
        data = value.data.detach().double()
        kept = sums.setdefault(value.key, [0.0, 0.0, 0.0])
        for index, part in enumerate((float(data.numel()), data.sum().item(), data.square().sum().item())):
            kept[index] += part
    gathered: list[dict[str, list[float]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)
    total: dict[str, list[float]] = {}
    for part in gathered:
        for key, values in (part or {}).items():
            kept = total.setdefault(key, [0.0, 0.0, 0.0])
            for index, value in enumerate(values):
                kept[index] += value
    return [[key, *total[key]] for key in sorted(total)]


def fingerprint_differs(saved: list[list], found: list[list]) -> str | None:
    """The first base tensor whose sums differ by more than their rounding could (1e-9 of Σx², and of the bound
    √(n·Σx²) on Σ|x| for Σx), or None."""
    if [row[0] for row in saved] != [row[0] for row in found]:
        return "the set of base tensors"
    for (key, n, s1, s2), (_, m, t1, t2) in zip(saved, found, strict=True):
        # the counts may differ by vocabulary padding rows (zeros), which change neither sum
        if abs(s2 - t2) > 1e-9 * max(s2, t2) or abs(s1 - t1) > 1e-9 * (max(n, m) * max(s2, t2)) ** 0.5:
            return key
    return None


def _rng_object(value: Any) -> ShardedObject:
    """One rank's generators, under its global rank (Megatron-LM keys them by its layout's ranks alike)."""
    return ShardedObject("rng_state", value, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def load(state: TrainState, root: str | Path, iteration: int, load_optim: bool = True,
         load_rng: bool = True) -> Resumed:
    """Every rank calls this; the counterpart of training.load for torch_dist iterations, at any layout."""
    root = Path(root)
    folder = root / mg.iteration_dir_name(iteration)
    common = common_state(folder)
    _check(state, root, iteration, common, load_optim)
    mismatch = state.lora.resume_mismatch(common.get("lora"))
    if mismatch:
        raise ConfigError(f"checkpoint {root} {mismatch}")
    saved_layout = common.get("mindrl_layout")
    # a checkpoint written before context parallelism records no CP: it ran at CP1
    same_ranks = saved_layout is not None and {"cp": 1, **saved_layout} == layout(state)
    if load_rng and not same_ranks and dist.get_rank() == 0:
        say(f"checkpoint {root} iteration {iteration} was saved at {_layout_text(saved_layout)} and resumes at "
            f"{_layout_text(layout(state))}: its random generator states belong to ranks of the old layout, so "
            f"they are not restored (the seeded ones go on; no_load_rng: true silences this).")
    record = common.get("lora") or {}
    if record.get("adapters_only"):
        differs = fingerprint_differs(record["base_fingerprint"], base_fingerprint(state.model))
        if differs:
            raise ConfigError(f"checkpoint {root} holds LoRA adapters only, trained on other base weights than the "
                              f"model's ({differs} differs); start the run from the base checkpoint they were "
                              f"trained on (its `initial_weights`), unchanged.")
    with initial_moments(state.optimizer, keep=True):
        model = _model_state(state)
        _check_shapes(folder, model, dist_checkpointing.load_tensors_metadata(str(folder)))
        sharded: dict[str, Any] = {"model": model}
        if load_optim:
            sharded["optimizer"] = state.optimizer.sharded_state_dict(model, is_loading=True,
                                                                      metadata=OPTIMIZER_SHARDING)
        if load_rng and same_ranks:
            sharded["rng_state"] = _rng_object(None)
        loaded = dist_checkpointing.load(sharded, str(folder), _load_strategy(state),
                                         strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    _load_model(state.model, loaded["model"], adapters_only=bool(record.get("adapters_only")))
    if load_optim:
        _load_optimizer(state, loaded["optimizer"], common)
        if not common.get("optimizer_stepped", True):
            for opt in optimizers(state.optimizer):
                opt.optimizer.state.clear()
    else:
        fresh_optimizer(state)
    if load_rng and same_ranks:
        rng.restore(loaded["rng_state"])
    return Resumed(int(common["iteration"]), dict(common.get("extra") or {}), int(common.get("actor_updates", 0)))


def stage_start(model: torch.nn.Module, root: str | Path, tp_rank: int, pp_rank: int, arch: ModelArch,
                par: ParallelConfig, ep_rank: int = 0, new_heads: tuple[str, ...] = ()) -> dict[str, Any]:
    """This rank's stage of the checkpoint at `root`, in either format, as a start point (`model`, and a legacy
    run's `lora` record), checked against the model: a legacy one must be at the model's layout, a distributed one
    is read into `model` at its own (`new_heads`: read_stage). Every rank calls it."""
    iteration = mg.read_tracker(root)
    if not files.is_dist(files.folder(root, iteration)):
        return mg.load_rank(root, tp_rank, pp_rank, arch, par, ep_rank=ep_rank)
    files.check_checkpoint(root, iteration, arch)
    files.check_start(root, iteration)
    return {"model": read_stage(model, root, iteration, new_heads), "lora": None}


def read_stage(model: torch.nn.Module, root: str | Path, iteration: int | str,
               new_heads: tuple[str, ...] = (), only_trained: bool = False) -> dict[str, Any]:
    """This rank's stage of a torch_dist iteration's weights, by the model's parameter names, at the model's
    layout (any layout wrote it), also put into `model`: a starting point, as a legacy rank file's `model` is.
    Parameters named with a
    prefix in `new_heads` (a critic's value head) are read where the checkpoint has them; `only_trained` reads
    what trains alone (an adapters-only checkpoint's adapters). Every rank calls it."""
    where = Path(root) / mg.iteration_dir_name(iteration)
    model_sd = model.sharded_state_dict()
    stored = dist_checkpointing.load_tensors_metadata(str(where))
    model_sd = {name: value for name, value in model_sd.items()
                if (not name.startswith(new_heads) or _key(value) in stored)
                and (not only_trained or getattr(value.data, "requires_grad", False))}
    _check_shapes(where, model_sd, stored)
    loaded = dist_checkpointing.load({"model": model_sd}, str(where), TorchDistLoadShardedStrategy(),
                                     strict=StrictHandling.ASSUME_OK_UNEXPECTED)["model"]
    weights = {name: value for name, value in loaded.items() if torch.is_tensor(value)}
    with torch.no_grad():  # read into the parameters' storage where the loader could; copied in where it could not
        model.load_state_dict(weights, strict=False)
    return weights


def _key(value: Any) -> str | None:
    return getattr(value, "key", None)


def _check_shapes(where: Path, model_sd: dict[str, Any], stored: dict[str, Any]) -> None:
    """Each of the model's tensors must be in the checkpoint with its whole-model shape: one sentence naming the
    first that is not (a checkpoint of another architecture, or another vocabulary padding), raised on every rank
    alike (a stage may find what another does not, and none may be left in the load's collectives)."""
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, _shape_problem(where, model_sd, stored))
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise ConfigError(problem)


def _shape_problem(where: Path, model_sd: dict[str, Any], stored: dict[str, Any]) -> str | None:
    for name, value in model_sd.items():
        key = _key(value)
        if key is None or name.endswith("_extra_state"):
            continue
        if key not in stored:
            return (f"torch_dist checkpoint {where} has no {key}, which the model has; it holds another "
                    f"architecture — point load at the right checkpoint or fix the model yaml.")
        want = getattr(value, "global_shape", None)
        have = tuple(stored[key].global_shape)
        if getattr(value, "allow_shape_mismatch", False) and want is not None:
            # the vocabulary's rows, padded to a multiple of TP: megatron-core reads the rows both have and zeroes
            # the rest (the real vocabulary, which the architecture check compared, is within both)
            have, want = have[1:], tuple(want)[1:]
        if want is not None and have != tuple(want):
            return (f"torch_dist checkpoint {where} holds {key} of shape {tuple(stored[key].global_shape)}, the "
                    f"model's is {tuple(want)}; it holds another architecture (or vocabulary padding) — point load "
                    f"at the right checkpoint or fix the model yaml.")
    return None


def _layout_text(saved: dict[str, int] | None) -> str:
    if not saved:
        return "an unrecorded layout"
    return f"TP={saved['tp']} PP={saved['pp']} EP={saved['ep']} DP={saved['dp']} CP={saved.get('cp', 1)}"


def _load_strategy(state: TrainState) -> Any:
    """megatron-core's torch_dist reader; spread over the data-parallel ranks on devices (its exchange of the
    shards each rank read runs through device memory, which a CPU rank has none of)."""
    strategy = TorchDistLoadShardedStrategy()
    if _replicas(state) > 1 and get_platform().name != "cpu":
        return FullyParallelLoadStrategyWrapper(strategy, _local_data_parallel_group())
    return strategy


def _check(state: TrainState, root: Path, iteration: int, common: dict[str, Any], load_optim: bool) -> None:
    from mindrl.models import arch_fields

    args = common.get("args")
    diffs = arch_fields.arch_differences(mg.arch_of(args, str(root)), state.arch, mg.parallel_of(args).tp)
    if diffs:
        raise ConfigError(f"checkpoint {root} iteration {iteration} holds a different architecture than model "
                          f"{state.arch.name}: " + ", ".join(diffs[:4]) + "; point load at the right checkpoint "
                          "or fix the model yaml.")
    if load_optim and "opt_param_scheduler" not in common:
        raise ConfigError(f"checkpoint {root} iteration {iteration} holds no optimizer state (starting weights); "
                          f"resume from it with no_load_optim and no_load_rng.")


@torch.no_grad()
def _load_model(model: torch.nn.Module, loaded: dict[str, Any], adapters_only: bool = False) -> None:
    """The loaded tensors were read into the parameters' own storage; anything else (a tensor the loader
    replaced) is copied in. An adapters-only checkpoint leaves the base as the run built it."""
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    missing = [k for k in missing if not k.endswith("_extra_state") and (k in trained or not adapters_only)]
    if missing or unexpected:
        raise ConfigError(f"the torch_dist checkpoint's model does not match this one: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}.")


@torch.no_grad()  # the fp32 master weights are views of parameters that require grad
def _load_optimizer(state: TrainState, loaded: Any, common: dict[str, Any]) -> None:
    """The master weights and moments from the model-space state; the optimizer's own hyper-parameters with the
    saved step count and loss scaler. The saved hyper-parameter groups are not read as they are: they are listed
    per optimizer of the saving layout (a mixture of experts at EP > 1 has one for its experts, at EP = 1 may
    not), and the LR schedule loaded after sets each group's rates anyway."""
    opts = optimizers(state.optimizer)
    step, scaler = _saved(loaded, "param_groups"), _saved(loaded, "grad_scaler")
    for index, opt in enumerate(opts):
        part = loaded if len(opts) == 1 else loaded[index]
        own = opt.state_dict()
        for group in own["optimizer"]["param_groups"]:
            group["step"] = step[0]["step"]
        if scaler is not None and "grad_scaler" in own:
            own["grad_scaler"] = scaler
        opt.load_state_dict(own)  # hyper-parameters, and the step into every parameter's state
        # torch's Adam keeps `step` per parameter, which megatron-core's loader of the master weights and moments
        # does not expect (it copies every per-parameter key from the file), and its load gave every parameter the
        # same step tensor, which Adam's in-place `step += 1` would advance once per parameter: set aside, then
        # one copy each
        steps = {param: kept.pop("step") for param, kept in opt.optimizer.state.items() if "step" in kept}
        try:
            opt.load_parameter_state_from_fully_reshardable(part["param_state"])
        finally:
            for param, kept_step in steps.items():
                opt.optimizer.state[param]["step"] = kept_step.clone()
    state.scheduler.num_steps = 0  # Megatron's load adds the saved steps to the current count
    state.scheduler.load_state_dict(common["opt_param_scheduler"])
    apply_loaded_schedule(state.scheduler)


def _saved(tree: Any, key: str) -> Any:
    """The first value under `key` in the saved optimizer state (every optimizer of a layout holds the same step
    count and scaler)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            found = _saved(value, key)
            if found is not None:
                return found
    return None
