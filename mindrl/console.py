"""The terminal for mindrl's own lines, the run's log file for everything else.

A run writes three kinds of output: mindrl's own lines (what starts, the precision, a resume, the
progress, errors), other libraries' warnings and notices (vLLM, torch, Ray, gloo — repeated in every
process), and tracebacks. Inside `run_log(path)` this process's file descriptors 1 and 2 point at the
log file, so every byte any library, C extension or child process writes there is kept in it; Ray
workers join it through `worker_setup` (Ray's worker_process_setup_hook), which reads the path from
the environment. mindrl's own lines reach the terminal through `say` and `error`, and are copied to
the log so that it reads as the whole story.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn, TextIO

#: environment variable naming the log every process of a run appends to (set for Ray's workers too)
RUN_LOG_ENV = "MINDRL_RUN_LOG"
#: Ray's hook that runs in each worker process before any task: `worker_setup`
WORKER_SETUP_HOOK = f"{__name__}.worker_setup"

_terminal: tuple[TextIO, TextIO] | None = None
_log: Path | None = None


def terminal_out() -> TextIO:
    """The terminal's standard output (this process's own while no run log is open)."""
    return _terminal[0] if _terminal else sys.stdout


def terminal_err() -> TextIO:
    return _terminal[1] if _terminal else sys.stderr


def say(line: str) -> None:
    """One of mindrl's own lines, on the terminal and in the run's log."""
    _write(terminal_out(), f"[mindrl] {line}")


def error(message: str) -> None:
    """An error for the user: `error: ...` on the terminal's stderr and in the run's log."""
    _write(terminal_err(), f"error: {message}")


def _write(stream: TextIO, text: str) -> None:
    print(text, file=stream, flush=True)
    if _terminal is not None:
        print(text, file=sys.stderr, flush=True)


def _redirect(path: str) -> None:
    """Point file descriptors 1 and 2 (and Python's streams over them) at the end of `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


@contextlib.contextmanager
def run_log(path: str | os.PathLike) -> Iterator[Path]:
    """Everything this process (and the Ray workers it starts) writes to stdout and stderr goes to `path`
    (appended, so a resumed run continues its log) until the block ends; mindrl's lines still reach the
    terminal. Nested use keeps (and yields) the outer log."""
    global _terminal, _log
    if _log is not None:
        yield _log
        return
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    _log = path
    saved = os.dup(1), os.dup(2)
    _terminal = (os.fdopen(os.dup(saved[0]), "w", buffering=1), os.fdopen(os.dup(saved[1]), "w", buffering=1))
    previous = os.environ.get(RUN_LOG_ENV)
    os.environ[RUN_LOG_ENV] = str(path)
    _redirect(str(path))
    try:
        yield path
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        for stream in _terminal:
            stream.close()
        _terminal = _log = None
        if previous is None:
            os.environ.pop(RUN_LOG_ENV, None)
        else:
            os.environ[RUN_LOG_ENV] = previous


def worker_setup() -> None:
    """In a Ray worker process, before it runs anything: its output joins the run's log. On another node the
    run's folder is made there (a shared file system has it already); where it cannot be, the worker keeps
    Ray's own log files, since a failing setup hook would keep the worker from starting at all."""
    path = os.environ.get(RUN_LOG_ENV)
    if path:
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            _redirect(path)
        except OSError:
            pass


def run_exit_handlers() -> None:
    """What an interpreter's exit does before it unwinds its modules: its other threads are joined, the exit
    handlers run (Ray's shutdown, logging's flush), and Python's streams are flushed. For processes that then
    end without the unwinding (`exit_now`, the ranks forked in mindrl.launch)."""
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


def exit_now(code: int) -> NoReturn:
    """End a command that has closed its files as an interpreter's exit would, less the unwinding of every
    module, which took 1.5 s of every trainer run here once megatron-core and vLLM were loaded; the C library's
    buffered output is written too."""
    run_exit_handlers()
    ctypes.CDLL(None).fflush(None)
    os._exit(code)
