"""Worker processes that run the verifiers, and the watchdog that makes the time limit hold.

A limit enforced only inside the scoring process does not hold: libraries catch broad
exceptions (math-verify's `except Exception` swallowed the alarm, and a power tower such as
9^{9^{9^{9}}} then ran with no limit at all), and no signal handler runs while C code does
not return to the interpreter or while a verifier catches everything. So samples are always
scored in child processes (one with verifier_parallel=1), each publishing which call it is
in and since when. The parent kills a child whose call overruns the limit by more than a
small grace, scores that call as a timeout, starts a fresh child and hands it the rest of
the work. It needs no signals of its own, so it works from any thread.

A child that holds work but neither starts a call nor reports for longer than a call may take is
wedged outside the verifiers (stopped, or starved): it is killed and its unfinished samples go to a fresh
child, as after a death that is not its own. A child wedged while its verifiers load (a custom verifier's
imports may take long) is left to the driver's deadline on the scoring phase (rl_config.phase_timeout).

A child that dies on its own (a verifier calling os._exit, a segfault, the OOM killer) has
not overrun anything: its unfinished samples are scored again, once, in a fresh child; a
second death in the same batch raises, since the rewards could not be trusted.

Children fork from a forkserver that has imported the verifiers already, so starting one
after a kill costs milliseconds, not the second it takes to import sympy.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from mindrl.rewards.worker import BETWEEN_CALLS, TIMEOUT, serve

GRACE_S = 0.2  # the child's own alarm gets this long to end an overrun before the kill
_STARTING_POLL_S = 0.05
_MAX_CHUNK = 256

Row = list[tuple[float, int]]


class VerifierCrash(RuntimeError):
    """A verifier worker process died on its own twice while scoring one batch."""


@dataclass
class _Child:
    process: BaseProcess
    conn: Connection
    state: Any
    sent: deque[int] = field(default_factory=deque)  # samples sent and not yet reported, in order
    sent_at: float = 0.0  # monotonic time of the last send


def _context() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "mindrl.rewards.verifiers", "mindrl.rewards.worker"])
    return context


_NONE_DECIDED: frozenset[int] = frozenset()


def _decided(row: list[tuple[float, int] | None]) -> frozenset[int]:
    """Verifiers already settled for a sample sent again (after a kill), which its new child skips."""
    return frozenset(k for k, cell in enumerate(row) if cell is not None) if any(row) else _NONE_DECIDED


def _stop_all(children: list[_Child]) -> None:
    for child in children:
        try:
            child.conn.send(None)
        except OSError:
            pass
    for child in children:
        child.process.join(timeout=1.0)
        if child.process.is_alive():
            child.process.kill()
            child.process.join()
        child.conn.close()
    children.clear()


class VerifierPool:
    """`processes` children scoring with the verifiers `names`, each call limited to `limit_s`."""

    def __init__(self, names: tuple[str, ...], limit_s: float, processes: int) -> None:
        self.names = names
        self.limit_s = limit_s
        self.processes = processes
        self._children: list[_Child] = []
        # A scorer dropped without close() must not leave its children running until exit.
        weakref.finalize(self, _stop_all, self._children)

    def score(self, items: list[tuple[str, str, int]]) -> list[Row]:
        """(score, status) per verifier for each (response, label, tool calls); a timed-out call has status
        TIMEOUT."""
        rows: list[list[tuple[float, int] | None]] = [[None] * len(self.names) for _ in items]
        work = deque(self._chunks(items))
        ahead = len(work[0]) if work else 0
        crashes = 0
        try:
            while len(self._children) < self.processes:
                self._children.append(self._start())
            while work or any(child.sent for child in self._children):
                for slot, child in enumerate(self._children):
                    # Up to one chunk queued behind the one in progress, so no child waits for the next.
                    if work and len(child.sent) < ahead and not self._send(child, work.popleft(), items, rows):
                        crashes = self._crashed(slot, crashes, rows, work)
                busy = [child for child in self._children if child.sent]
                ready = wait([child.conn for child in busy], timeout=self._until_next_deadline(busy))
                for slot, child in enumerate(self._children):
                    if not child.sent:
                        continue
                    if child.conn in ready and not self._receive(child, rows):
                        crashes = self._crashed(slot, crashes, rows, work)
                    elif self._overran(child):
                        self._cut_off(slot, rows, work)
                    elif self._wedged(child):
                        self._stop(slot, rows, work)
        except BaseException:
            self.close()
            raise
        return rows  # type: ignore[return-value]  (every entry is filled once the loop ends)

    def close(self) -> None:
        _stop_all(self._children)

    def _chunks(self, items: list[tuple[str, str, int]]) -> list[list[int]]:
        """Samples sharing a label go together, so each child works out a label once per group."""
        by_label: dict[str, list[int]] = {}
        for index, (_, label, _) in enumerate(items):
            by_label.setdefault(label, []).append(index)
        order = [index for group in by_label.values() for index in group]
        size = max(1, min(_MAX_CHUNK, -(-len(order) // (self.processes * 4))))
        return [order[start:start + size] for start in range(0, len(order), size)]

    def _start(self) -> _Child:
        context = _context()
        parent_end, child_end = context.Pipe()
        state = context.RawArray("d", 4)
        process = context.Process(target=serve, args=(child_end, state, self.names, self.limit_s),
                                  name="mindrl-verifier", daemon=True)
        process.start()
        child_end.close()
        return _Child(process, parent_end, state)

    def _send(self, child: _Child, chunk: list[int], items: list[tuple[str, str, int]],
              rows: list[list[tuple[float, int] | None]]) -> bool:
        task = [(index, *items[index], _decided(rows[index])) for index in chunk]
        child.sent.extend(chunk)
        child.sent_at = time.monotonic()
        try:
            child.conn.send(task)
        except OSError:  # the child is gone
            return False
        return True

    def _receive(self, child: _Child, rows: list[list[tuple[float, int] | None]]) -> bool:
        """Take every finished sample the child has reported; False if it has died."""
        try:
            while child.conn.poll():
                for index, row in child.conn.recv():
                    child.sent.remove(index)
                    if None not in row:
                        rows[index] = row
                        continue
                    for k, cell in enumerate(row):
                        if cell is not None:
                            rows[index][k] = cell
        except (EOFError, OSError):
            return False
        return True

    def _until_next_deadline(self, busy: list[_Child]) -> float:
        now = time.monotonic()
        deadlines = [child.state[2] + self.limit_s + GRACE_S if child.state[2] != BETWEEN_CALLS
                     else now + _STARTING_POLL_S for child in busy]
        return max(0.0, min(deadlines) - now) if deadlines else 0.0

    def _overran(self, child: _Child) -> bool:
        started = child.state[2]
        return started != BETWEEN_CALLS and time.monotonic() - started > self.limit_s + GRACE_S

    def _wedged(self, child: _Child) -> bool:
        """Outside any call, with work, and silent since the last send or sign of life for longer than a call
        may take (its next call starts, or its report goes out, within milliseconds of the last)."""
        last = child.state[3]
        return (child.state[2] == BETWEEN_CALLS and last != 0.0
                and time.monotonic() - max(last, child.sent_at) > self.limit_s + GRACE_S)

    def _stop(self, slot: int, rows: list[list[tuple[float, int] | None]], work: deque[list[int]]) -> _Child:
        """Kill the child in `slot`, keep what it reported, put its unfinished samples first in line."""
        child = self._children[slot]
        child.process.kill()
        child.process.join()
        self._receive(child, rows)
        child.conn.close()
        if child.sent:
            work.appendleft(list(child.sent))
        self._children[slot] = self._start()
        return child

    def _cut_off(self, slot: int, rows: list[list[tuple[float, int] | None]], work: deque[list[int]]) -> None:
        child = self._stop(slot, rows, work)
        index, k, started = int(child.state[0]), int(child.state[1]), child.state[2]
        # The call in progress at the kill is the overrun one unless it had only just begun.
        if started != BETWEEN_CALLS and time.monotonic() - started >= self.limit_s and index in child.sent:
            rows[index][k] = (0.0, TIMEOUT)

    def _crashed(self, slot: int, crashes: int, rows: list[list[tuple[float, int] | None]],
                 work: deque[list[int]]) -> int:
        child = self._children[slot]
        index, k, started = int(child.state[0]), int(child.state[1]), child.state[2]
        child.process.join(timeout=1.0)
        where = (f"while {self.names[k]!r} scored sample {index}" if started != BETWEEN_CALLS
                 else "between samples")
        if crashes >= 1:
            raise VerifierCrash(f"a verifier worker process died twice in one batch (exit code "
                                f"{child.process.exitcode}, {where}); a verifier is ending its own process on "
                                f"some input, so this batch has no trustworthy rewards — fix that verifier.")
        self._stop(slot, rows, work)
        return crashes + 1
