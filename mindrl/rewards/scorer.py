"""Weighted rule rewards for a batch of responses, with a time limit per sample.

reward_i = Σ_k weight_k · verifier_k(response_i, label_i)  (+ the overlong penalty)

Each verifier call runs under a SIGALRM timer: a sample that hangs (a pathological
expression in sympy) or raises scores 0 for that verifier and is counted in the metrics;
the batch goes on. SIGALRM only reaches a process's main thread, so scoring happens
either in the caller's main thread (verifier_parallel=1) or in a pool of worker
processes, which also scores large batches in parallel.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from mindrl.config.reward import RewardConfig
from mindrl.rewards.overlong import overlong_penalty
from mindrl.rewards.registry import get_verifier

OK, TIMEOUT, ERROR = 0, 1, 2


class _SampleTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _SampleTimeout


def _score_items(names: tuple[str, ...], items: list[tuple[str, str]], time_limit_s: float
                 ) -> list[list[tuple[float, int]]]:
    """(score, status) per item per verifier; must run in a main thread."""
    verifiers = [get_verifier(name) for name in names]
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    out = []
    try:
        for response, label in items:
            row = []
            for verifier in verifiers:
                try:
                    signal.setitimer(signal.ITIMER_REAL, time_limit_s)
                    try:
                        row.append((float(verifier(response, label)), OK))
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                except _SampleTimeout:
                    row.append((0.0, TIMEOUT))
                except Exception:
                    row.append((0.0, ERROR))
            out.append(row)
    finally:
        signal.signal(signal.SIGALRM, previous)
    return out


@dataclass
class ScoreResult:
    """Total reward per response, each verifier's unweighted scores, and batch metrics."""

    rewards: list[float]
    scores: dict[str, list[float]]
    metrics: dict[str, float] = field(default_factory=dict)


class RewardScorer:
    """Scores batches with the verifiers and weights of a RewardConfig."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.names = tuple(config.verifier_function)
        for name in self.names:  # fail on a bad name now, not in the middle of a run
            get_verifier(name)
        self._pool: ProcessPoolExecutor | None = None

    def _workers(self) -> int:
        """Worker processes to use; 0 means score here."""
        if self.config.verifier_parallel > 1:
            return self.config.verifier_parallel
        return 0 if threading.current_thread() is threading.main_thread() else 1  # the timer needs one

    def _pool_for(self, workers: int) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
        return self._pool

    def _score_all(self, items: list[tuple[str, str]]) -> list[list[tuple[float, int]]]:
        workers = self._workers()
        limit = self.config.verifier_timeout
        if workers == 0:
            return _score_items(self.names, items, limit)
        size = max(1, -(-len(items) // (workers * 4)))
        chunks = [items[i:i + size] for i in range(0, len(items), size)]
        try:
            futures = [self._pool_for(workers).submit(_score_items, self.names, c, limit) for c in chunks]
            return [row for future in futures for row in future.result()]
        except BrokenProcessPool:
            # A worker died outright (not a Python error): count the batch as errors, start afresh.
            self.close()
            return [[(0.0, ERROR)] * len(self.names) for _ in items]

    def score(self, responses: list[str], labels: list[str],
              response_lengths: list[int] | None = None) -> ScoreResult:
        """Rewards for `responses` against `labels` (token lengths needed for the overlong penalty)."""
        if len(responses) != len(labels):
            raise ValueError(f"{len(responses)} responses but {len(labels)} labels; give one label each.")
        cfg = self.config
        if cfg.overlong_buffer_enable and (response_lengths is None or len(response_lengths) != len(responses)):
            raise ValueError("overlong_buffer_enable needs the token length of every response.")
        rows = self._score_all(list(zip(responses, labels, strict=True)))
        rewards = [sum(w * row[k][0] for k, w in enumerate(cfg.verifier_weight)) for row in rows]
        scores = {name: [row[k][0] for row in rows] for k, name in enumerate(self.names)}
        n = max(len(rows), 1)
        metrics: dict[str, float] = {}
        for k, name in enumerate(self.names):
            metrics[f"{name}_rewards/mean"] = sum(scores[name]) / n
            metrics[f"{name}/timeout_fraction"] = sum(row[k][1] == TIMEOUT for row in rows) / n
            metrics[f"{name}/error_fraction"] = sum(row[k][1] == ERROR for row in rows) / n
        if cfg.overlong_buffer_enable:
            penalties = [overlong_penalty(length, cfg.rollout_max_tokens, cfg.overlong_buffer,
                                          cfg.overlong_buffer_penalty_factor) for length in response_lengths]
            rewards = [r + p for r, p in zip(rewards, penalties, strict=True)]
            metrics["overlong/penalty_mean"] = sum(penalties) / n
            metrics["overlong/fraction"] = sum(p < 0 for p in penalties) / n
        metrics["reward/mean"] = sum(rewards) / n
        return ScoreResult(rewards=rewards, scores=scores, metrics=metrics)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
