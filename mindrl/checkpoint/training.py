"""Training checkpoints of the actor, in Megatron-LM's layout, written atomically, resumed exactly.

    ROOT/latest_checkpointed_iteration.txt          the last complete iteration (written last)
    ROOT/iter_0000100/mp_rank_TT[_PPP][_EEE]/   (_EEE: a mixture of experts' expert-parallel rank)
        model_optim_rng.pt   model, args, iteration, optimizer (its unsharded part: hyper-parameters,
                             step), opt_param_scheduler, rng_state (one entry per data-parallel rank),
                             actor_updates, extra (the caller's: data position, trainer step, ...)
        distrib_optim.pt     the distributed optimizer's fp32 master weights and Adam moments

One `distrib_optim.pt` per model-parallel rank, as Megatron-LM writes it (megatron-core's
gathered "dp_zero" format), rather than one file per data-parallel rank: the gathered state is
the parameter buffer's contents without padding, which does not depend on how many
data-parallel ranks share it, so a run resumes its optimizer at another DP size; the file set
is the one Megatron-LM / MindSpeed users know; and the sharding code is megatron-core's own.
The price is a gather of the stage's optimizer state to data-parallel rank 0 (12 bytes per
parameter of the stage / TP, in host memory) at every save.

With expert parallelism each expert-parallel rank's experts (and their optimizer's state, gathered over the
expert-data-parallel group) live on other ranks than the layers around them: the first expert-data-parallel
replica of every EP rank writes its folder, as Megatron-LM does; the layers around the experts (and their
optimizer state) are read back from EP rank 0's.

Atomicity: all ranks write into ROOT/.tmp-iter_XXXXXXX; only when every rank reports success
does rank 0 rename it into place and then rewrite the tracker. A failure or a killed rank
leaves the previous iteration and the tracker as they were; the next save removes the leftover.
Every rank must see ROOT (one machine, or a shared file system, as Megatron-LM assumes).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mindrl.checkpoint import megatron as mg
from mindrl.checkpoint import publish, rng
from mindrl.config import ConfigError, ModelArch, ParallelConfig
from mindrl.config.lora import LoraConfig
from mindrl.models import arch_fields
from mindrl.models.gpt import load_stage_weights


@dataclass(frozen=True)
class TrainState:
    """One rank's training state, handed over by whoever trains it: the checkpoint layer writes and restores
    these objects in place and knows nothing of the worker that holds them."""

    model: torch.nn.Module
    #: megatron-core's (distributed) optimizer over `model`
    optimizer: Any
    #: megatron-core's OptimizerParamScheduler
    scheduler: Any
    arch: ModelArch
    par: ParallelConfig
    #: optimizer steps taken so far (the rollout engine's weights are current when it saw this count)
    updates: int = 0
    #: the model's LoRA adapters (none: a model trained in full)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    #: the digest of this rank's frozen base weights (mindrl.models.lora.base_digest), asked for by adapters-only saves
    #: and loads
    base_digest: Callable[[], str] | None = None

    @property
    def ranks(self) -> tuple[int, int, int, int]:
        """(tensor, pipeline, data-parallel rank, data-parallel size) of this process."""
        return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
                parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size())

    @property
    def ep_rank(self) -> int:
        return parallel_state.get_expert_model_parallel_rank() if self.par.ep > 1 else 0

    @property
    def writes(self) -> bool:
        """Whether this rank writes its folder: the first data-parallel replica's first context-parallel rank (the
        CP ranks hold the same weights), or with EP the first expert-data-parallel replica of each expert-parallel
        rank (that group spans the context-parallel ranks too)."""
        if self.par.ep > 1:
            return parallel_state.get_expert_data_parallel_rank() == 0
        return parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_context_parallel_rank() == 0

    def rank_folder(self) -> str:
        tp_rank, pp_rank = self.ranks[:2]
        return mg.rank_dir_name(tp_rank, pp_rank, self.par.pp, self.ep_rank, self.par.ep)


@dataclass(frozen=True)
class Resumed:
    """What a load hands back: the iteration, the caller's extra state, and the update count to continue from."""

    iteration: int
    extra: dict[str, Any]
    updates: int = 0


def optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Every tensor the optimizer keeps: its (master) parameters and their state (Adam's moments and step)."""
    tensors = []
    for opt in optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                tensors.append(param)
                tensors.extend(v for v in opt.optimizer.state.get(param, {}).values() if torch.is_tensor(v))
    return tensors


def _is_sharded(optimizer: Any) -> bool:
    return any(hasattr(opt, "get_parameter_state_dp_zero") for opt in optimizers(optimizer))


class _Recorded:
    """A file whose failed write is kept: torch.save reports one as an assertion of its zip writer ("unexpected
    pos …"), which loses the OS error (a full disk, a file too large) a user has to act on."""

    def __init__(self, file: Any) -> None:
        self.file, self.error = file, None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def _write(obj: Any, path: Path) -> None:
    """torch.save, flushed to the disk before the directory is renamed into place; a failed write is the OS's
    error, naming the file."""
    with open(path, "wb") as f:
        recorded = _Recorded(f)
        try:
            torch.save(obj, recorded)
        except RuntimeError as err:
            if recorded.error is None:
                raise
            raise OSError(recorded.error.errno, f"{recorded.error.strerror}: {path}") from err
        f.flush()
        os.fsync(f.fileno())


def check_plain(extra: dict[str, Any]) -> None:
    """Refuse extra state that torch.load(weights_only=True) could not read back, naming the key."""
    for key, value in extra.items():
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        try:
            torch.load(buffer, weights_only=True)
        except pickle.UnpicklingError:
            raise ValueError(f"extra checkpoint state {key!r} is a {type(value).__name__}; keep extra state to "
                             f"numbers, strings, None, lists, tuples, dicts and tensors, so it loads without "
                             f"running code.") from None


def save(state: TrainState, root: str | Path, iteration: int, extra: dict[str, Any] | None = None) -> Path:
    """Every rank calls this; returns the iteration's directory once the tracker names it."""
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"checkpoint iteration must be a non-negative integer, got {iteration!r}.")
    extra = dict(extra or {})
    check_plain(extra)
    with initial_moments(state.optimizer, keep=False) as stepped:
        return _save(state, Path(root), iteration, extra, stepped)


@contextmanager
def initial_moments(optimizer: Any, keep: bool) -> Iterator[bool]:
    """Whether the optimizer has taken a step (PPO's critic warm-up saves an actor that has not). Before the first
    step there are no Adam moments, which megatron-core's state_dict, gather and sharded state dict read: inside,
    they are the zeros (and step 0) Adam starts from; unless `keep` (a load, which overwrites them) they are dropped
    again after, so the next step initialises them as it would have."""
    opts = optimizers(optimizer)
    stepped = any(opt.optimizer.state for opt in opts)
    if not stepped:
        for opt in opts:
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    opt.optimizer.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                                  "exp_avg_sq": torch.zeros_like(param)}
    try:
        yield stepped
    finally:
        if not stepped and not keep:
            for opt in opts:
                opt.optimizer.state.clear()


def _save(state: TrainState, root: Path, iteration: int, extra: dict[str, Any], stepped: bool) -> Path:
    sharded = _is_sharded(state.optimizer)
    dp_size = state.ranks[3]
    rng_states: list[Any] = [None] * dp_size
    dist.all_gather_object(rng_states, rng.capture(), group=parallel_state.get_data_parallel_group())
    param_state = None
    if sharded:  # a collective over the data-parallel group; data-parallel rank 0 receives it
        states = [opt.get_parameter_state_dp_zero() for opt in optimizers(state.optimizer)]
        param_state = states[0] if len(states) == 1 else states
    tmp = publish.tmp_dir(root, iteration)
    what = f"saving checkpoint iteration {iteration} to {root}"
    after = f"{publish.what_is_kept(root)} — free space or fix the folder, then resume with load={root}"
    first = dist.get_rank() == 0
    try:
        publish.together(lambda: publish.prepare(root, tmp), first, what, after)
        publish.together(lambda: _write_rank(state, tmp, iteration, rng_states, param_state, extra, stepped),
                         state.writes, what, after)
    except publish.SaveFailed:
        if first:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish.together(lambda: publish.publish(root, tmp, iteration), first, what, after)
    return root / mg.iteration_dir_name(iteration)


def _write_rank(state: TrainState, tmp: Path, iteration: int, rng_states: list[Any], param_state: Any,
                extra: dict[str, Any], stepped: bool) -> None:
    dp_size = state.ranks[3]
    folder = tmp / state.rank_folder()
    folder.mkdir()
    if param_state is not None:
        _write(param_state, folder / mg.OPTIM_FILE)
    args = mg.checkpoint_args(state.arch, state.par, state.model.config.params_dtype,
                              data_parallel_size=dp_size, use_distributed_optimizer=param_state is not None)
    adapters_only = state.lora.ckpt_filter
    contents = {
        "model": {name: mg.compact(p.detach().cpu()) for name, p in state.model.named_parameters()
                  if p.requires_grad or not adapters_only},
        "iteration": iteration,
        "checkpoint_version": mg.CHECKPOINT_VERSION,
        "args": args,
        "optimizer": state.optimizer.state_dict(),
        "optimizer_stepped": stepped,
        "opt_param_scheduler": state.scheduler.state_dict(),
        "rng_state": rng_states,
        "actor_updates": state.updates,
        "extra": extra,
    }
    if state.lora.enabled:
        contents["lora"] = {"r": state.lora.r, "alpha": state.lora.alpha,
                            "target_modules": list(state.lora.target_modules), "adapters_only": adapters_only,
                            "base_digest": state.base_digest() if adapters_only else None}
    _write(contents, folder / mg.RANK_FILE)


def load(state: TrainState, root: str | Path, iteration: int | None = None, load_optim: bool = True,
         load_rng: bool = True) -> Resumed:
    """Every rank calls this. Restores the weights always, the optimizer and LR scheduler unless
    `load_optim` is false (a fresh optimizer and schedule on the loaded weights), and the random
    generators unless `load_rng` is false. Everything is checked before anything is changed."""
    root = Path(root)
    iteration = mg.read_tracker(root) if iteration is None else iteration
    if iteration == "release":
        raise ConfigError(f"{root} holds converted weights (release), not a training checkpoint; start the actor "
                          f"from it as its initial weights instead of resuming.")
    _check_layout(state, root, iteration, mg.load_args(root, iteration))
    tp_rank, pp_rank, dp_rank, _ = state.ranks
    path = mg.existing_rank_file(root, iteration, tp_rank, pp_rank, state.par.pp, state.ep_rank, state.par.ep)
    contents = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    _check_contents(state, path, contents, load_optim, load_rng)
    _check_lora(state, path, contents.get("lora"))
    trained = {name for name, p in state.model.named_parameters() if p.requires_grad}
    load_stage_weights(state.model, contents["model"],
                       only=trained if (contents.get("lora") or {}).get("adapters_only") else None)
    if load_optim:
        _load_optimizer(state, contents, path.with_name(mg.OPTIM_FILE))
        if not contents.get("optimizer_stepped", True):  # saved before its first step: no moments to restore
            for opt in optimizers(state.optimizer):
                opt.optimizer.state.clear()
    else:
        fresh_optimizer(state)
    if load_rng:
        rng.restore(contents["rng_state"][dp_rank])
    return Resumed(int(contents["iteration"]), dict(contents.get("extra", {})), int(contents.get("actor_updates", 0)))


def _check_layout(state: TrainState, root: Path, iteration: int, args: Any) -> None:
    stored, par = mg.parallel_of(args), state.par
    if (stored.tp, stored.pp, stored.num_layer_list, stored.ep) != (par.tp, par.pp, par.num_layer_list, par.ep):
        layers = f" layers {','.join(map(str, stored.num_layer_list))}" if stored.num_layer_list else ""
        moe = stored.ep > 1 or par.ep > 1
        saved_ep, run_ep = (f" EP={stored.ep}", f" EP={par.ep}") if moe else ("", "")
        flag = f" --target-expert-parallel-size {par.ep}" if moe else ""
        raise ConfigError(
            f"checkpoint {root} iteration {iteration} was saved at TP={stored.tp} PP={stored.pp}{saved_ep}{layers} "
            f"but the actor runs TP={par.tp} PP={par.pp}{run_ep}; re-shard it with cli/convert_ckpt.py "
            f"--load-model-type mg --save-model-type mg --target-tensor-parallel-size {par.tp} "
            f"--target-pipeline-parallel-size {par.pp}{flag} and resume from that with no_load_optim and "
            f"no_load_rng, or run the actor at TP={stored.tp} PP={stored.pp}{saved_ep}.")
    diffs = arch_fields.arch_differences(mg.arch_of(args, str(root)), state.arch, stored.tp)
    if diffs:
        raise ConfigError(f"checkpoint {root} iteration {iteration} holds a different architecture than model "
                          f"{state.arch.name}: " + ", ".join(diffs[:4]) + "; point load at the right checkpoint "
                          "or fix the model yaml.")


def _check_contents(state: TrainState, path: Path, contents: dict[str, Any], load_optim: bool,
                    load_rng: bool) -> None:
    """What resuming asks for must be there: a converted or re-sharded checkpoint has weights only.
    Every rank checks the same things, so all of them stop together."""
    root, iteration = path.parents[2], contents.get("iteration")
    dp_size = state.ranks[3]
    if load_optim and "optimizer" not in contents:
        raise ConfigError(f"checkpoint {root} iteration {iteration} holds no optimizer state (converted or "
                          f"re-sharded weights); resume from it with no_load_optim and no_load_rng.")
    if load_rng and "rng_state" not in contents:
        raise ConfigError(f"checkpoint {root} iteration {iteration} holds no RNG state (converted or re-sharded "
                          f"weights); resume from it with no_load_rng.")
    saved_dp = len(contents["rng_state"]) if load_rng else dp_size
    if saved_dp != dp_size:
        raise ConfigError(f"checkpoint {root} iteration {iteration} was saved with {saved_dp} data-parallel ranks "
                          f"but the actor has {dp_size}; RNG states are kept per data-parallel rank, so "
                          f"resume with no_load_rng (the optimizer state re-shards) or with {saved_dp} "
                          f"data-parallel ranks.")
    optim_file = path.with_name(mg.OPTIM_FILE)
    if load_optim and _is_sharded(state.optimizer) and not optim_file.is_file():
        raise FileNotFoundError(f"checkpoint {root} lacks {optim_file.relative_to(root)}; it is incomplete.")


def _check_lora(state: TrainState, path: Path, saved: dict[str, Any] | None) -> None:
    """The checkpoint's adapters are the model's (rank, alpha, layers), and an adapters-only checkpoint goes back on
    the base it was trained on; one sentence otherwise, before anything is loaded."""
    root = path.parents[2]
    mismatch = state.lora.resume_mismatch(saved)
    if mismatch:
        raise ConfigError(f"checkpoint {root} {mismatch}")
    if saved and saved["adapters_only"] and saved["base_digest"] != state.base_digest():
        raise ConfigError(f"checkpoint {root} holds LoRA adapters only, trained on other base weights than the "
                          f"model's (digest {saved['base_digest']}, the model's {state.base_digest()}); start the run "
                          f"from the base checkpoint they were trained on (its `initial_weights`), unchanged.")


@torch.no_grad()  # the fp32 master weights are views of parameters that require grad
def _load_optimizer(state: TrainState, contents: dict[str, Any], optim_file: Path) -> None:
    state.optimizer.load_state_dict(contents["optimizer"])
    if _is_sharded(state.optimizer):  # a collective: data-parallel rank 0 reads and scatters
        # Two megatron-core 0.16 slips on torch's Adam, which keeps `step` per parameter: the loader
        # copies every per-parameter key from the file, which holds no `step` (it came with
        # `optimizer` above), so set it aside; and load_state_dict gave every parameter the *same*
        # step tensor, which Adam's in-place `step += 1` would then advance once per parameter.
        steps = [(opt.optimizer.state, param, kept.pop("step")) for opt in optimizers(state.optimizer)
                 for param, kept in opt.optimizer.state.items() if "step" in kept]
        try:
            state.optimizer.load_parameter_state(str(optim_file))
        finally:
            for states, param, step in steps:
                states[param]["step"] = step.clone()
    state.scheduler.num_steps = 0  # Megatron's load adds the saved steps to the current count
    state.scheduler.load_state_dict(contents["opt_param_scheduler"])
    apply_loaded_schedule(state.scheduler)


def apply_loaded_schedule(scheduler: Any) -> None:
    """The rates of the schedule the load settled on, in the param groups before the first resumed update.
    megatron-core's load sets them (its step) before it reads the checkpoint's weight decay, so that update would
    take this config's. With override_opt_param_scheduler the groups also take the config's `max_lr` / `min_lr`:
    each group carries its own, loaded with the optimizer's state (the checkpoint's), and get_lr prefers those
    (Megatron-LM issue 1138: the override would mix the checkpoint's bounds with the config's warm-up and decay)."""
    if scheduler.override_opt_param_scheduler:
        for group in scheduler.optimizer.param_groups:
            group["max_lr"], group["min_lr"] = scheduler.max_lr, scheduler.min_lr
    scheduler.step(increment=0)


@torch.no_grad()
def fresh_optimizer(state: TrainState) -> None:
    """Megatron's --no-load-optim: Adam's moments and the LR schedule start over (so a warm-up
    protects the fresh moments), and the master weights are taken from the loaded model."""
    for opt in optimizers(state.optimizer):
        opt.optimizer.state.clear()
    state.optimizer.reload_model_params()
    state.scheduler.num_steps = 0
    state.scheduler.step(increment=0)
