"""Rule rewards scored by Ray CPU actors, one per node, while the workers compute log-probs.

Each scorer holds a RewardScorer (its verifier processes and their time limit live inside
it); a batch is cut into one contiguous part per scorer. `submit` returns at once, so the
driver starts the reference and old log-prob passes and collects the rewards after them.
On a CPU run the roles' ranks hold the cores Ray counts, so the scorers claim no CPU there
and share the cores; elsewhere each claims `num_cpus_for_local_task`.
"""

from __future__ import annotations

from typing import Any

from mindrl.config.reward import RewardConfig
from mindrl.rewards.scorer import RewardScorer, ScoreResult


class ScorerActor:
    def __init__(self, config: RewardConfig) -> None:
        self.scorer = RewardScorer(config)

    def score(self, responses: list[str], labels: list[str], lengths: list[int]) -> ScoreResult:
        return self.scorer.score(responses, labels, lengths)

    def close(self) -> None:
        self.scorer.close()


class RuleRewards:
    def __init__(self, config: RewardConfig, num_cpus: float) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
        remote = ray.remote(ScorerActor)
        self.actors = [remote.options(num_cpus=num_cpus, name=f"mindrl-rule-reward-{i}",
                                      scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                                      ).remote(config) for i, node in enumerate(nodes)]

    def submit(self, responses: list[str], labels: list[str], lengths: list[int]) -> list[Any]:
        count = len(self.actors)
        bounds = [len(responses) * i // count for i in range(count + 1)]
        return [actor.score.remote(responses[a:b], labels[a:b], lengths[a:b])
                for actor, a, b in zip(self.actors, bounds, bounds[1:], strict=False)]

    @staticmethod
    def collect(refs: list[Any]) -> ScoreResult:
        """The parts in order as one result; each metric is the sample-weighted mean of the parts'."""
        import ray

        parts: list[ScoreResult] = ray.get(refs)
        total = sum(len(p.rewards) for p in parts) or 1
        metrics = {key: sum(p.metrics.get(key, 0.0) * len(p.rewards) for p in parts) / total
                   for key in parts[0].metrics}
        scores = {name: [s for p in parts for s in p.scores[name]] for name in parts[0].scores}
        return ScoreResult([r for p in parts for r in p.rewards], scores, metrics)

    def close(self) -> None:
        import ray

        ray.get([actor.close.remote() for actor in self.actors])
        for actor in self.actors:
            ray.kill(actor)
