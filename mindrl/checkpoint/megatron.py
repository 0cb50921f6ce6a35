"""Megatron's legacy per-rank checkpoint layout.

    SAVE/latest_checkpointed_iteration.txt         "release" or the iteration number
    SAVE/release/ | SAVE/iter_0000100/
        mp_rank_TT/model_optim_rng.pt              PP = 1
        mp_rank_TT_PPP/model_optim_rng.pt          PP > 1
        mp_rank_TT[_PPP]_EEE/model_optim_rng.pt    EP > 1: expert-parallel rank EEE's file holds the
                                                   layers around the experts (the same in every EEE)
                                                   and its num_experts / EP experts, numbered from 0

Each rank file is a dict with `model` (that rank's stage state dict), `iteration`,
`checkpoint_version` and `args`: an argparse.Namespace with the Megatron argument names
of the architecture and layout (so Megatron-LM tools can read it) plus `mindrl_arch`,
the exact ModelArch, so a loader can tell a wrong TP/PP or architecture in one sentence.

Rank files written by Megatron-LM or MindSpeed-LLM load too: they are unpickled without
running their code (unpickle.py), their args are read by Megatron-LM's names
(megatron_args.py) and their model chunks mapped onto the same names (chunks.py).
"""

from __future__ import annotations

import argparse
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from mindrl.checkpoint import chunks, megatron_args, mla_names
from mindrl.checkpoint.atomic import atomic_file
from mindrl.checkpoint.megatron_args import checkpoint_args as checkpoint_args  # re-exported for writers
from mindrl.checkpoint.unpickle import load_rank_file
from mindrl.config import ConfigError, ModelArch, ParallelConfig
from mindrl.models import arch_fields

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
#: the distributed optimizer's state, beside a training checkpoint's rank file
OPTIM_FILE = "distrib_optim.pt"
CHECKPOINT_VERSION = 3.0

torch.serialization.add_safe_globals([argparse.Namespace])


def iteration_dir_name(iteration: int | str) -> str:
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron-LM's (and MindSpeed-LLM's) name of a rank's folder."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep == 1 else f"{name}_{ep_rank:03d}"


def holds_training_state(root: str | Path, iteration: int | str) -> bool:
    """Whether the iteration keeps optimizer state beside its weights: a training checkpoint, as opposed to
    converted or re-sharded weights (which a run can start from but not resume)."""
    files = sorted((Path(root) / iteration_dir_name(iteration)).glob(f"mp_rank_*/{RANK_FILE}"))
    return bool(files) and ((files[0].parent / OPTIM_FILE).is_file() or "optimizer" in load_rank_file(files[0]))


def tp_rank_of(path: str | Path) -> int:
    """The TP rank of a rank file, from its folder's name (rank_dir_name)."""
    found = re.match(r"mp_rank_(\d+)", Path(path).parent.name)
    if found is None:
        raise ConfigError(f"{path} is not in an mp_rank_TT folder, so its TP rank is unknown; keep a checkpoint's "
                          f"rank files in the folders Megatron names.")
    return int(found.group(1))


def rank_file(root: str | Path, iteration: int | str, tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0,
              ep: int = 1) -> Path:
    return Path(root) / iteration_dir_name(iteration) / rank_dir_name(tp_rank, pp_rank, pp, ep_rank, ep) / RANK_FILE


def existing_rank_file(root: str | Path, iteration: int | str, tp_rank: int, pp_rank: int, pp: int,
                       ep_rank: int = 0, ep: int = 1) -> Path:
    """The path of one rank's file, or one sentence saying the checkpoint is incomplete."""
    path = rank_file(root, iteration, tp_rank, pp_rank, pp, ep_rank, ep)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {root} lacks {path.relative_to(root)}; it is incomplete.")
    return path


def iterations(root: str | Path) -> list[int]:
    """The numbered iterations `root` holds a folder for, ascending."""
    return sorted(int(d.name[len("iter_"):]) for d in Path(root).glob("iter_*") if d.name[len("iter_"):].isdigit())


def damage(root: str | Path, iteration: int) -> str | None:
    """Why training checkpoint `iteration` of `root` cannot be loaded whole, or None. A write cut short (a full
    disk, a killed job, a copy interrupted) leaves a torch archive without the zip directory at its end, or a rank
    folder missing: each file's directory is read, not its tensors, so this is quick at any size."""
    folder = Path(root) / iteration_dir_name(iteration)
    files = sorted(folder.glob("mp_rank_*/*.pt"))
    if not files:
        return f"{folder} holds no rank files"
    for path in files:
        with open(path, "rb") as f:
            head = f.read(2)
        if not head:
            return f"{path} is empty"
        if head != b"PK":
            continue  # torch's legacy (pre-zip) format, from another writer: nothing to check cheaply
        try:
            zipfile.ZipFile(path).close()
        except (zipfile.BadZipFile, OSError) as err:
            return f"{path} is cut short or damaged ({err})"
    par = parallel_of(load_args(root, iteration))
    expected = {rank_dir_name(t, p, par.pp, e, par.ep) for t in range(par.tp) for p in range(par.pp)
                for e in range(par.ep)}
    missing = sorted(expected - {path.parent.name for path in files if path.name == RANK_FILE})
    return f"{folder} lacks {missing[0]}/{RANK_FILE} of its TP={par.tp} PP={par.pp} layout" if missing else None


def newest_complete(root: str | Path, below: int) -> int | None:
    """The newest iteration before `below` that `damage` finds nothing wrong with."""
    return next((it for it in reversed(iterations(root)) if it < below and damage(root, it) is None), None)


def read_tracker(root: str | Path) -> int | str:
    """The iteration the tracker file names ("release" or an int)."""
    path = Path(root) / TRACKER
    if not path.is_file():
        raise FileNotFoundError(f"{root} has no {TRACKER}; it is not a Megatron checkpoint directory "
                                f"(convert HF weights with cli/convert_ckpt.py first).")
    text = path.read_text().strip()
    if text == "release":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path} holds {text!r}; expected 'release' or an iteration number.") from None


def write_tracker(root: str | Path, iteration: int | str) -> None:
    """Written last, so a reader never sees an iteration whose files are incomplete."""
    with atomic_file(Path(root) / TRACKER) as tmp:
        tmp.write_text(f"{iteration}\n")


def save_rank(root: str | Path, iteration: int | str, tp_rank: int, pp_rank: int,
              model: dict[str, torch.Tensor], args: argparse.Namespace, ep_rank: int = 0, **extra: Any) -> Path:
    """One rank's file of one iteration (the caller writes the tracker when all ranks are done)."""
    path = rank_file(root, iteration, tp_rank, pp_rank, args.pipeline_model_parallel_size, ep_rank,
                     getattr(args, "expert_model_parallel_size", 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": {name: compact(t) for name, t in model.items()},
             "iteration": 0 if iteration == "release" else int(iteration),
             "checkpoint_version": CHECKPOINT_VERSION, "args": args, **extra}
    torch.save(state, path)
    return path


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor with a storage of exactly its own bytes.

    torch.save writes a view's whole storage: a TP slice or a memory-mapped row range
    saved as is would carry the full tensor (or file) along with it.
    """
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


def check_format(root: str | Path, iteration: int | str) -> Path:
    """The iteration's folder, after refusing Megatron's distributed (torch_dist) format in one sentence: the
    converter's command line and the trainers read it through mindrl/checkpoint/dist.py instead."""
    folder = Path(root) / iteration_dir_name(iteration)
    if (folder / "metadata.json").is_file() or any(folder.glob("*.distcp")):
        raise ConfigError(f"checkpoint {root} is in Megatron's distributed format (torch_dist), which this reader of "
                          f"per-rank files does not take; convert it with cli/convert_ckpt.py, which reads it (or "
                          f"re-save it with Megatron-LM's --ckpt-convert-format torch --ckpt-convert-save DIR).")
    return folder


def load_args(root: str | Path, iteration: int | str | None = None) -> argparse.Namespace | None:
    """The args stored with a checkpoint, read from its first rank file (tensors only mapped)."""
    iteration = read_tracker(root) if iteration is None else iteration
    folder = check_format(root, iteration)
    first = sorted(folder.glob(f"mp_rank_00*/{RANK_FILE}"))
    if not first:
        raise FileNotFoundError(f"{folder} has no mp_rank_00*/{RANK_FILE}; the checkpoint is incomplete.")
    return load_rank_file(first[0]).get("args")


def arch_of(args: argparse.Namespace | None, name: str = "checkpoint", hf_vocab: int | None = None) -> ModelArch:
    return megatron_args.arch_from_args(args, name, hf_vocab)


def parallel_of(args: argparse.Namespace) -> ParallelConfig:
    return megatron_args.parallel_from_args(args)


def read_rank(path: str | Path, mmap: bool = True) -> dict[str, Any]:
    """A rank file's model chunks (normalized, see chunks.normalize_model), args, iteration, LoRA record and extra.

    Optimizer, scheduler and RNG state are loaded as inert placeholders (see unpickle) and left out.
    """
    state = load_rank_file(path, mmap)
    version = state.get("checkpoint_version")
    if isinstance(version, int | float) and version < CHECKPOINT_VERSION:
        raise ConfigError(f"{path} has checkpoint_version {version}; mindrl reads megatron-core checkpoints "
                          f"(version {CHECKPOINT_VERSION}), so re-save it with a current Megatron-LM.")
    keys = chunks.model_keys(state)
    if not keys:
        raise ConfigError(f"{path} holds no model state dict (keys: {', '.join(map(str, list(state)[:6]))}); "
                          f"it is an optimizer-only or foreign file.")
    local_experts = _local_experts(state.get("args"))
    mla = mla_names.mla_cut(state.get("args"), tp_rank_of(path))
    out: dict[str, Any] = {key: chunks.normalize_model(state[key], f"{path} [{key}]", local_experts, mla)
                           for key in keys}
    # a LoRA run's record (mindrl/checkpoint/training.py) and the trainer's extra (its `initial_weights`): a start
    # from the checkpoint merges its adapters, and the converter finds the base an adapters-only one was trained on
    out.update(args=state.get("args"), iteration=state.get("iteration"), checkpoint_version=version,
               lora=state.get("lora"), extra=state.get("extra"))
    return out


def _local_experts(args: Any) -> int | None:
    experts = getattr(args, "num_experts", None)
    return int(experts) // int(getattr(args, "expert_model_parallel_size", None) or 1) if experts else None


def load_rank(root: str | Path, tp_rank: int, pp_rank: int, expect_arch: ModelArch | None = None,
              expect_par: ParallelConfig | None = None, iteration: int | str | None = None,
              mmap: bool = True, ep_rank: int = 0) -> dict[str, Any]:
    """One rank's state, after checking the checkpoint matches the model it is loaded into."""
    iteration = read_tracker(root) if iteration is None else iteration
    stored_par = check_checkpoint(root, iteration, expect_arch, expect_par)
    return read_rank(existing_rank_file(root, iteration, tp_rank, pp_rank, stored_par.pp, ep_rank, stored_par.ep),
                     mmap)


def check_checkpoint(root: str | Path, iteration: int | str, expect_arch: ModelArch | None = None,
                     expect_par: ParallelConfig | None = None) -> ParallelConfig:
    """Refuse a checkpoint another model or layout would be loaded from (read from its args alone, so a
    driver can ask before any worker starts); returns its layout."""
    args = load_args(root, iteration)
    stored_arch, stored_par = arch_of(args, str(root)), parallel_of(args)
    if megatron_args.virtual_stages(args) > 1:
        raise ConfigError(f"checkpoint {root} has a virtual pipeline ({megatron_args.virtual_stages(args)} "
                          f"chunks per rank); re-shard it with cli/convert_ckpt.py --load-model-type mg "
                          f"--save-model-type mg first.")
    if expect_par is not None and (expect_par.tp, expect_par.pp, expect_par.num_layer_list, expect_par.ep) != (
            stored_par.tp, stored_par.pp, stored_par.num_layer_list, stored_par.ep):
        stored_list = ",".join(map(str, stored_par.num_layer_list or ()))
        stored_ep = f" EP={stored_par.ep}" if stored_par.ep > 1 or expect_par.ep > 1 else ""
        expect_ep = f" EP={expect_par.ep}" if stored_ep else ""
        raise ConfigError(
            f"checkpoint {root} is sharded TP={stored_par.tp} PP={stored_par.pp}{stored_ep}"
            f"{' layers ' + stored_list if stored_list else ''} but the model is "
            f"TP={expect_par.tp} PP={expect_par.pp}{expect_ep}; re-shard it with cli/convert_ckpt.py "
            f"or match the layout.")
    if expect_arch is not None:
        diffs = arch_fields.arch_differences(stored_arch, expect_arch, stored_par.tp)
        if diffs:
            raise ConfigError(
                f"checkpoint {root} holds a different architecture than model {expect_arch.name}: "
                + ", ".join(diffs[:4]) + "; point load at the right checkpoint or fix the model yaml.")
    return stored_par
