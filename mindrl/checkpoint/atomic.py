"""Write a file or a directory so that readers see all of it or none of it.

Everything is written into a temporary sibling of the target and renamed into place at
the end; a failure removes the temporary and leaves the target as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path


def check_target(target: str | Path, overwrite: bool, inputs: Iterable[str | Path | None] = ()) -> Path:
    """Refuse a non-empty target unless told to overwrite, and a target that is or holds one of the
    `inputs` the work reads: replacing it would delete them (checked before any work starts)."""
    target = Path(target)
    for source in filter(None, inputs):
        if Path(source).resolve().is_relative_to(target.resolve()):
            raise FileExistsError(f"the save directory {target} is or holds the input {source}, which writing "
                                  f"there would delete; choose a save directory outside it.")
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory; choose another save directory.")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(f"{target} is not empty; choose an empty save directory or pass --overwrite.")
    return target


@contextlib.contextmanager
def atomic_file(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `target`; once written, it replaces `target` in one rename."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        yield tmp
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(target: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; on success it becomes `target`.

    With `overwrite`, an existing target is replaced only after the new one is complete,
    and removed only after the rename succeeded.
    """
    target = check_target(target, overwrite).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        old = None
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
        tmp.rename(target)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
