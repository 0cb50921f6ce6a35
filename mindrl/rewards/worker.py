"""The loop of a verifier worker process: score what the parent sends, and say where it is.

`state` is shared with the parent: [sample index, verifier index, monotonic start time of
the call in progress (0.0 between calls), monotonic time of the last sign of life outside a call (0.0 while
the verifiers load)]. The parent kills this process when a call runs
past its limit (see pool). A SIGALRM raised here is only the cheap first line: it ends
most overruns (pure-Python loops in sympy) without costing a process, and it is a
BaseException so that `except Exception` in a library or verifier cannot swallow it; a
bare `except:` still can, and C code that does not return to the interpreter never lets it run.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

from mindrl.rewards.registry import Verifier, get_verifier, takes_tool_calls

OK, TIMEOUT, ERROR = 0, 1, 2
BETWEEN_CALLS = 0.0
FLUSH_S = 0.02

# (sample index, response, label, its tool calls, verifier indices already decided for this sample)
Task = list[tuple[int, str, str, int, frozenset[int]]]


class _Overrun(BaseException):
    pass


_armed = False


def _on_alarm(signum, frame):
    if _armed:  # an alarm delivered after the call returned must not hit the loop
        raise _Overrun


def score_one(verifier: Verifier, response: str, label: str, limit_s: float,
              tool_calls: int | None = None) -> tuple[float, int]:
    """(score, status) of one call; a non-finite score is an error, it would poison the advantages.
    `tool_calls` is passed only when not None: a verifier that does not declare it is called as it always was."""
    global _armed
    try:
        try:
            _armed = True
            signal.setitimer(signal.ITIMER_REAL, limit_s)
            score = float(verifier(response, label) if tool_calls is None
                          else verifier(response, label, tool_calls=tool_calls))
        finally:
            _armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Overrun:
        return 0.0, TIMEOUT
    except Exception:
        return 0.0, ERROR
    return (score, OK) if math.isfinite(score) else (0.0, ERROR)


def serve(conn: Connection, state: Sequence[float], names: tuple[str, ...], limit_s: float) -> None:
    """Score tasks until sent None, reporting [(index, row), ...] at least every FLUSH_S and at a task's end.

    A row has None where the verifier was already decided. Finished samples not yet reported
    when the parent kills this process are simply scored again, so reports can be batched.
    """
    verifiers = [get_verifier(name) for name in names]
    counted = [takes_tool_calls(verifier) for verifier in verifiers]  # once per verifier, not per sample
    signal.signal(signal.SIGALRM, _on_alarm)
    state[3] = time.monotonic()
    while (task := conn.recv()) is not None:
        state[3] = time.monotonic()
        finished: list[tuple[int, list[tuple[float, int] | None]]] = []
        reported_at = time.monotonic()
        for index, response, label, tool_calls, decided in task:
            row: list[tuple[float, int] | None] = []
            for k, verifier in enumerate(verifiers):
                if k in decided:
                    row.append(None)
                    continue
                state[0], state[1], state[2] = index, k, time.monotonic()
                row.append(score_one(verifier, response, label, limit_s, tool_calls if counted[k] else None))
                state[2], state[3] = BETWEEN_CALLS, time.monotonic()
            finished.append((index, row))
            if time.monotonic() - reported_at >= FLUSH_S:
                conn.send(finished)
                finished, reported_at = [], time.monotonic()
        conn.send(finished)
