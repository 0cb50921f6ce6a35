"""Weighted rule rewards for a batch of responses, with a time limit per sample that holds.

reward_i = Σ_k weight_k · verifier_k(response_i, label_i)  (+ the overlong penalty)

A verifier that declares a `tool_calls` parameter is also given sample i's number of tool calls.

The verifiers run in worker processes (see pool). A call that overruns `verifier_timeout`
is cut off; one that raises or returns no finite number fails. Either way the sample gets
that verifier's fail score — its worst score unless `verifier_fail_score` says otherwise —
so that no policy can gain by making the verifier time out, and it is counted in the
metrics; the batch goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mindrl.config.reward import RewardConfig
from mindrl.rewards.overlong import overlong_penalty
from mindrl.rewards.pool import VerifierPool
from mindrl.rewards.registry import fail_score, get_verifier
from mindrl.rewards.worker import ERROR, OK, TIMEOUT


@dataclass
class ScoreResult:
    """Total reward per response, each verifier's unweighted scores, and batch metrics."""

    rewards: list[float]
    scores: dict[str, list[float]]
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def concatenate(cls, parts: list[ScoreResult]) -> ScoreResult:
        """The parts' samples in order as one result, with the metrics the whole would have had.

        Every metric is a mean over samples, so each becomes the sample-weighted mean of the parts';
        a population `<x>/std` beside its `<x>/mean` is pooled from the parts' means and stds.
        """
        total = sum(len(p.rewards) for p in parts) or 1
        keys = [key for key in parts[0].metrics if all(key in p.metrics for p in parts)]
        metrics = {key: sum(p.metrics[key] * len(p.rewards) for p in parts) / total for key in keys}
        for key in keys:
            mean = key.removesuffix("/std") + "/mean"
            if key.endswith("/std") and mean in metrics:
                second = sum((p.metrics[key] ** 2 + p.metrics[mean] ** 2) * len(p.rewards) for p in parts) / total
                metrics[key] = max(second - metrics[mean] ** 2, 0.0) ** 0.5
        scores = {name: [s for p in parts for s in p.scores[name]] for name in parts[0].scores}
        return cls([r for p in parts for r in p.rewards], scores, metrics)


def fail_scores(config: RewardConfig) -> list[float]:
    """Each verifier's score for a timed-out or failed sample (raises for a verifier that has none)."""
    configured = config.verifier_fail_score or [None] * len(config.verifier_function)
    return [fail_score(name, value) for name, value in zip(config.verifier_function, configured, strict=True)]


class RewardScorer:
    """Scores batches with the verifiers and weights of a RewardConfig."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.names = tuple(config.verifier_function)
        for name in self.names:  # fail on a bad name now, not in the middle of a run
            get_verifier(name)
        self.fail_scores = fail_scores(config)
        self._pool: VerifierPool | None = None

    def score(self, responses: list[str], labels: list[str], response_lengths: list[int] | None = None,
              tool_calls: list[int] | None = None) -> ScoreResult:
        """Rewards for `responses` against `labels` (token lengths needed for the overlong penalty). `tool_calls`,
        each response's number of tool calls (a multi-turn rollout's), goes to the verifiers that declare it;
        None, as in a single-turn run, gives them 0 each."""
        if len(responses) != len(labels):
            raise ValueError(f"{len(responses)} responses but {len(labels)} labels; give one label each.")
        if tool_calls is None:
            tool_calls = [0] * len(responses)
        elif len(tool_calls) != len(responses):
            raise ValueError(f"{len(responses)} responses but {len(tool_calls)} tool-call counts; give one count "
                             f"each.")
        cfg = self.config
        if cfg.overlong_buffer_enable and (response_lengths is None or len(response_lengths) != len(responses)):
            raise ValueError("overlong_buffer_enable needs the token length of every response.")
        if self._pool is None:
            self._pool = VerifierPool(self.names, cfg.verifier_timeout, cfg.verifier_parallel)
        rows = self._pool.score(list(zip(responses, labels, tool_calls, strict=True))) if responses else []
        scores = {name: [row[k][0] if row[k][1] == OK else self.fail_scores[k] for row in rows]
                  for k, name in enumerate(self.names)}
        rewards = [sum(w * scores[name][i] for name, w in zip(self.names, cfg.verifier_weight, strict=True))
                   for i in range(len(rows))]
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
            self._pool.close()
            self._pool = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
