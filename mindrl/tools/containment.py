"""Bounds on a sandbox as a whole — all its processes together — where rlimits bound each process alone.

Two ways, each used where it works:
- **A cgroup per call** (`CallCgroup`), where the machine delegates cgroup v1 hierarchies to this process: its cgroup
  in the `memory` (and `pids`) hierarchy is not the hierarchy's root and is writable. The sandbox starts inside a
  child made below it for the call (never beside it, never at a root) and removed after: `memory.limit_in_bytes`
  bounds everything the call holds in memory — its processes, its tmpfs files, the kernel's objects for them —
  and `pids.max` its processes. An unprivileged user has no such delegation, nor has cgroup v2 without a
  delegated subtree; there the closed routes alone hold (mindrl/tools/sandbox.py, docs/tools.md).
- **Accounting of the sandbox's process tree** (`tree_usage`), in every mode: the CPU seconds of every process
  that ran in it, and the proportional memory (PSS, so pages shared after a fork count once) of those alive. The
  caller samples it while the code runs and ends the sandbox when a total passes its limit.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path

#: the kernel's bookkeeping for a call beside what its limits count (page tables, inodes, the sandbox's own
#: processes), allowed on top of them in the call's cgroup
KERNEL_ALLOWANCE = 64 << 20
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_names = itertools.count()
#: what the call cgroups' names start with, before the pid of the process that made them
_PREFIX = "mindrl-sandbox-"


@dataclass(frozen=True)
class Usage:
    cpu_seconds: float
    memory_bytes: int


def can_watch() -> bool:
    """Whether this kernel lists a process's children (CONFIG_PROC_CHILDREN), which the watch walks."""
    return os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (the sandbox's processes: its pid namespace keeps them under bwrap, orphans
    included, which its init adopts)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:  # it ended while we looked
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(child) for child in f.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def tree_usage(pid: int) -> Usage:
    """The CPU seconds of every process that ran below `pid`, and the memory of those alive below it.

    A process's own time is in its /proc stat while it lives; once it has ended and been waited for, its reaper's
    `cutime`/`cstime` hold it (its children's too), and an orphan's reaper is the namespace's init, which lives
    until the sandbox ends. So the sum over the living of own + waited-for children's time counts every process
    once (a zombie still shows its own, until its reaper adds it). Memory is PSS and its swapped-out share from
    smaps_rollup (RSS where the kernel has none)."""
    ticks, resident = 0, 0
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime
        resident += _memory(child, int(fields[21]))
    return Usage(ticks / _CLOCK_TICKS, resident)


def _memory(pid: int, rss_pages: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            kilobytes = [int(line.split()[1]) for line in f if line.startswith(("Pss:", "SwapPss:"))]
    except OSError:
        kilobytes = []
    return sum(kilobytes) << 10 if kilobytes else rss_pages * _PAGE


def _sweep(parent: Path) -> None:
    """Remove the call cgroups that processes now gone left below `parent` (a rollout process killed mid-call)."""
    for folder in parent.glob(f"{_PREFIX}*"):
        try:
            os.kill(int(folder.name[len(_PREFIX):].split("-")[0]), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):  # still holding a process: not ours to take
                folder.rmdir()
        except (ValueError, PermissionError):
            continue


@functools.cache
def _delegated(controller: str) -> Path | None:
    """This process's cgroup in the v1 hierarchy of `controller`, if a child may be made below it: not the
    hierarchy's root, and writable. Looked up once a process (it stays where it starts), when the calls that
    processes now gone left below it are swept."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    path = next((line.split(":", 2)[2] for line in lines
                 if controller in line.split(":", 2)[1].split(",")), None)
    if path in (None, "/"):
        return None
    for mount in mounts:
        pre, _, post = mount.partition(" - ")
        fields, kind = pre.split(), post.split()
        if kind and kind[0] == "cgroup" and controller in kind[-1].split(","):
            root, point = fields[3], fields[4]
            if not path.startswith(root):
                return None
            folder = Path(point) / path[len(root):].lstrip("/")
            if not (folder.is_dir() and os.access(folder, os.W_OK)):
                return None
            _sweep(folder)
            return folder
    return None


class CallCgroup:
    """One call's cgroup in each delegated hierarchy (memory, pids), made below this process's own."""

    def __init__(self, folders: dict[str, Path]) -> None:
        self.folders = folders

    @classmethod
    def create(cls, memory_bytes: int, processes: int) -> CallCgroup | None:
        """None where no hierarchy is delegated here (or the child cannot be made): the closed routes then hold."""
        limits = {"memory": ("memory.limit_in_bytes", memory_bytes + KERNEL_ALLOWANCE), "pids": ("pids.max", processes)}
        folders: dict[str, Path] = {}
        name = f"{_PREFIX}{os.getpid()}-{next(_names)}"
        for controller, (knob, value) in limits.items():
            parent = _delegated(controller)
            if parent is None:
                continue
            folder = parent / name
            try:
                folder.mkdir()
                folders[controller] = folder
                (folder / knob).write_text(str(value))
                if controller == "memory":
                    with contextlib.suppress(OSError):  # swap accounting is optional: bound it where there is one
                        (folder / "memory.memsw.limit_in_bytes").write_text(str(value))
            except OSError:
                cls(folders).remove()
                return None
        return cls(folders) if folders else None

    @property
    def procs_files(self) -> list[str]:
        """What the sandbox's first process writes its pid to, before it starts anything."""
        return [str(folder / "cgroup.procs") for folder in self.folders.values()]

    def ran_out_of_memory(self) -> bool:
        """Whether the kernel killed a process of the call for its memory limit (reaching the limit and reclaiming,
        `memory.failcnt`, is no failure)."""
        folder = self.folders.get("memory")
        if folder is None:
            return False
        try:
            oom = (folder / "memory.oom_control").read_text()
        except OSError:
            return False
        return any(line.split()[1] != "0" for line in oom.splitlines() if line.startswith("oom_kill "))

    def remove(self) -> None:
        """Remove the call's cgroups once its processes are gone (they leave a moment after the sandbox's init)."""
        for folder in self.folders.values():
            deadline = time.monotonic() + 5
            while folder.exists():
                try:
                    folder.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
