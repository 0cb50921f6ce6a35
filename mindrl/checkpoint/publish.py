"""Publishing a checkpoint iteration whole or not at all, whichever format its files are in.

All ranks write into ROOT/.tmp-iter_XXXXXXX; only when every rank reports success does rank 0 rename it into
place and then rewrite the tracker. A failure or a killed rank leaves the previous iteration and the tracker as
they were; the next save removes the leftover. Each step is taken together: every rank learns whether it failed
anywhere, and how, so none is left waiting in a collective for one that gave up.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mindrl.checkpoint import megatron as mg
from mindrl.config.errors import RunError
from mindrl.platform import get_platform

TMP, OLD = ".tmp-", ".old-"


class SaveFailed(RunError):
    """A step of a save failed on some rank; every rank raises it, in one sentence that names the first failing
    rank's error (disk full, a file too large, a folder it may not write) and what is left intact."""


def together(action: Callable[[], Any], here: bool, what: str, after: str) -> None:
    """Run `action` on the ranks where `here`; then every rank learns whether it failed anywhere, and how, and
    raises if so (collectives, so no rank is left waiting for one that gave up): "`what` failed on rank r (its
    error); `after`." """
    error = None
    if here:
        try:
            action()
        except Exception as err:
            error = err
    flags = torch.zeros(dist.get_world_size(), device=get_platform().device())
    flags[dist.get_rank()] = float(error is not None)
    dist.all_reduce(flags)
    failed = flags.nonzero().flatten().tolist()
    if failed:
        causes: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(causes, None if error is None else f"{type(error).__name__}: {error}")
        raise SaveFailed(f"{what} failed on rank {failed[0]} ({causes[failed[0]]}); {after}.") from error


def clear_leftovers(root: Path) -> None:
    """Remove what interrupted saves left; a set-aside iteration whose replacement never landed
    is put back, so nothing the tracker may name is lost."""
    for old in root.glob(f"{OLD}iter_*"):
        final = root / old.name[len(OLD):]
        if final.exists():
            shutil.rmtree(old)
        else:
            old.rename(final)
    for tmp in [*root.glob(f"{TMP}iter_*"), *root.glob(f"{TMP}export-*")]:
        shutil.rmtree(tmp)


def prepare(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    clear_leftovers(root)
    tmp.mkdir()


def publish(root: Path, tmp: Path, iteration: int) -> None:
    """Rename the finished directory into place (replacing a previous save of this iteration), then the tracker."""
    final = root / mg.iteration_dir_name(iteration)
    old = root / f"{OLD}{final.name}"
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)
    mg.write_tracker(root, iteration)


def what_is_kept(root: Path) -> str:
    """What a failed save leaves for a resume, in words: the tracker's iteration, untouched."""
    if (root / mg.TRACKER).is_file():
        return f"the checkpoints before it are untouched and the tracker still names iteration {mg.read_tracker(root)}"
    return "no earlier checkpoint was there"


def tmp_dir(root: Path, iteration: int) -> Path:
    """Where the ranks write an iteration before it is published."""
    return root / f"{TMP}{mg.iteration_dir_name(iteration)}"
