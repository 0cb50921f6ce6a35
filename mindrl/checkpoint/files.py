"""What a driver asks of a checkpoint iteration before any worker starts, in either format: Megatron's legacy
per-rank files (`torch`, mindrl/checkpoint/megatron.py) or megatron-core's distributed one (`torch_dist`,
mindrl/checkpoint/dist.py). The format is read from the files; a run's `ckpt_format` says which it writes, and
loading the other is refused unless `auto_detect_ckpt_format` (Megatron-LM's rule)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mindrl.checkpoint import megatron as mg
from mindrl.config import ConfigError, ModelArch, ParallelConfig
from mindrl.models import arch_fields

#: megatron-core's distributed format: an iteration folder with metadata.json naming it
FORMAT = "torch_dist"
FORMATS = ("torch", FORMAT)
COMMON_FILE = "common.pt"
CONFIG_FILE = "metadata.json"


def check_ckpt_format(ckpt_format: str, async_save: bool, section: str, swap_optimizer: bool = False) -> None:
    """The save settings, with swap_optimizer's: a background save would still be reading the optimizer state when
    the swap moves it to host memory (on a CPU that frees what the writer reads)."""
    if ckpt_format not in FORMATS:
        raise ConfigError(f"{section}.ckpt_format must be one of {', '.join(FORMATS)}, got {ckpt_format!r}.")
    if async_save and ckpt_format != FORMAT:
        raise ConfigError(f"{section}.async_save writes megatron-core's distributed checkpoints in the background, "
                          f"but ckpt_format is {ckpt_format}; set ckpt_format: torch_dist or async_save: false.")
    if async_save and swap_optimizer:
        raise ConfigError(f"{section}.async_save writes the optimizer state in the background, but swap_optimizer "
                          f"moves it to host memory as soon as the save returns; set one of them to false.")


def is_dist(where: str | Path) -> bool:
    return (Path(where) / CONFIG_FILE).is_file()


def common_state(folder: str | Path) -> dict[str, Any]:
    """What every rank of a torch_dist iteration shares (args, iteration, schedule, extra), read without a
    process group or megatron's loaders; tensors only mapped."""
    path = Path(folder) / COMMON_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no {COMMON_FILE}; the checkpoint is incomplete.")
    return mg.load_rank_file(path)


def dist_damage(folder: str | Path) -> str | None:
    """Why a torch_dist iteration cannot be loaded whole, or None: its index, common state and every shard file
    the index names must be there, each as long as the index says (read from the index, not the tensors)."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = Path(folder)
    for name in (CONFIG_FILE, ".metadata", COMMON_FILE):
        if not (folder / name).is_file() or (folder / name).stat().st_size == 0:
            return f"{folder} lacks {name}"
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
        index = FileSystemReader(str(folder)).read_metadata()
    except Exception as err:  # a cut or foreign index: any reader error means it cannot be loaded
        return f"{folder}'s index is damaged ({type(err).__name__}: {err})"
    if config.get("sharded_backend") != FORMAT:
        return f"{folder} is in the {config.get('sharded_backend')!r} distributed format; mindrl reads {FORMAT}"
    ends: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = folder / name
        if not path.is_file():
            return f"{folder} lacks {name}"
        if path.stat().st_size < end:
            return f"{path} is cut short ({path.stat().st_size} of {end} bytes)"
    return None


def folder(root: str | Path, iteration: int | str) -> Path:
    return Path(root) / mg.iteration_dir_name(iteration)


def format_of(root: str | Path, iteration: int | str | None = None) -> str:
    iteration = mg.read_tracker(root) if iteration is None else iteration
    return FORMAT if is_dist(folder(root, iteration)) else "torch"


def check_format(root: str | Path, iteration: int | str, ckpt_format: str, auto_detect: bool, key: str) -> None:
    """Refuse files of the other format than `ckpt_format` unless `auto_detect`, naming both fixes."""
    found = format_of(root, iteration)
    if found != ckpt_format and not auto_detect:
        section = key.rsplit(".", 1)[0]
        raise ConfigError(f"{key}={root} is in the {found} format but {section}.ckpt_format is {ckpt_format}; set "
                          f"ckpt_format: {found} (which the run's saves then use too) or auto_detect_ckpt_format: "
                          f"true.")


def first_state(root: str | Path, iteration: int | str) -> dict[str, Any]:
    """What every rank of an iteration shares: its args, iteration, LoRA record and the trainer's extra state (a
    legacy checkpoint's first rank file, a distributed one's common state; tensors only mapped)."""
    where = folder(root, iteration)
    if is_dist(where):
        return common_state(where)
    files = sorted(where.glob(f"mp_rank_*/{mg.RANK_FILE}"))
    if not files:
        raise ConfigError(f"{where} holds no {mg.RANK_FILE}; the checkpoint is incomplete — point load at another.")
    return mg.load_rank_file(files[0])


def load_args(root: str | Path, iteration: int | str | None = None) -> argparse.Namespace | None:
    iteration = mg.read_tracker(root) if iteration is None else iteration
    if is_dist(folder(root, iteration)):
        return first_state(root, iteration).get("args")
    return mg.load_args(root, iteration)


def holds_training_state(root: str | Path, iteration: int | str) -> bool:
    if is_dist(folder(root, iteration)):
        return "opt_param_scheduler" in first_state(root, iteration)
    return mg.holds_training_state(root, iteration)


def damage(root: str | Path, iteration: int) -> str | None:
    where = folder(root, iteration)
    return dist_damage(where) if is_dist(where) else mg.damage(root, iteration)


def newest_complete(root: str | Path, below: int) -> int | None:
    """The newest iteration before `below` that `damage` finds nothing wrong with, in either format."""
    return next((it for it in reversed(mg.iterations(root)) if it < below and damage(root, it) is None), None)


def check_checkpoint(root: str | Path, iteration: int | str, expect_arch: ModelArch | None = None,
                     expect_par: ParallelConfig | None = None) -> None:
    """Refuse a checkpoint another model would be loaded from; a legacy one must also be at the model's layout
    (a distributed one loads at any)."""
    if not is_dist(folder(root, iteration)):
        mg.check_checkpoint(root, iteration, expect_arch, expect_par)
        return
    args = load_args(root, iteration)
    if args is not None and expect_arch is not None:  # without args (a bare save), the ranks compare the shapes
        diffs = arch_fields.arch_differences(mg.arch_of(args, str(root)), expect_arch, mg.parallel_of(args).tp)
        if diffs:
            raise ConfigError(f"checkpoint {root} holds a different architecture than model {expect_arch.name}: "
                              + ", ".join(diffs[:4]) + "; point load at the right checkpoint or fix the model yaml.")


def check_start(root: str | Path, iteration: int | str, key: str = "load") -> None:
    """A LoRA run's torch_dist checkpoint is resumed, not started from: its adapters would have to be merged into
    the base at the new run's layout (the legacy files merge them); one sentence naming the way round."""
    where = folder(root, iteration)
    if is_dist(where) and common_state(where).get("lora"):
        raise ConfigError(f"{key}={root} is a LoRA run's torch_dist checkpoint, which mindrl resumes but does not "
                          f"start from; export it with cli/convert_ckpt.py --load-model-type mg --save-model-type "
                          f"hf (which merges the adapters) and start from that model converted back (hf -> mg).")
