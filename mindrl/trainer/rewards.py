"""A step's rewards: rule verifiers on Ray CPU actors (one per node) and the reward model on its own
devices, both scored while the workers compute log-probs, then added up (Rewards).

Each scorer holds a RewardScorer (its verifier processes and their time limit live inside
it); a batch is cut into one contiguous part per scorer. `submit` returns at once, so the
driver starts the reference and old log-prob passes and collects the rewards after them.
On a CPU run the roles' ranks hold the cores Ray counts, so the scorers claim no CPU there
and share the cores; elsewhere each claims `num_cpus_for_local_task`.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

import torch

from mindrl.config.reward import RewardConfig
from mindrl.rewards.scorer import RewardScorer, ScoreResult
from mindrl.trainer.metrics import StepTimer
from mindrl.trainer.reward_model import REWARD_MODEL, RewardModelGroup, RunningStats, normalise


class ScorerActor:
    def __init__(self, config: RewardConfig) -> None:
        self.scorer = RewardScorer(config)

    def score(self, responses: list[str], labels: list[str], lengths: list[int],
              tool_calls: list[int] | None = None) -> ScoreResult:
        return self.scorer.score(responses, labels, lengths, tool_calls)

    def close(self) -> None:
        self.scorer.close()


class RuleRewards:
    """One scorer per node. A scorer that stops answering (its process stopped, its verifier processes wedged
    where their own time limit does not reach) holds the step: `phase_timeout_s` (rl_config.phase_timeout)
    bounds the wait, as it does the ranks'."""

    def __init__(self, config: RewardConfig, num_cpus: float, phase_timeout_s: float = 0.0) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from mindrl.workers.group import hold

        nodes = [(node["NodeID"], node["NodeManagerAddress"]) for node in ray.nodes() if node["Alive"]]
        remote = ray.remote(ScorerActor)
        self.actors = [remote.options(num_cpus=num_cpus, name=f"mindrl-rule-reward-{i}",
                                      scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                                      ).remote(config) for i, (node, _) in enumerate(nodes)]
        self.phase_timeout_s = phase_timeout_s
        self.node_ids = [node for node, _ in nodes]
        self.nodes = [f"{address} ({node[:8]})" for node, address in nodes]
        for i, node in enumerate(self.node_ids):
            hold(node, "rule-reward", "scorer", i, len(self.actors))
        #: scorers still scoring when their time ran out: they take no other call (close) before that ends
        self.stuck: set[int] = set()

    def submit(self, responses: list[str], labels: list[str], lengths: list[int],
               tool_calls: list[int] | None = None) -> tuple[float, list[Any]]:
        """(when, the parts' refs): the deadline counts from the submission. `tool_calls`: see RewardScorer.score."""
        count = len(self.actors)
        bounds = [len(responses) * i // count for i in range(count + 1)]
        return time.perf_counter(), [actor.score.remote(responses[a:b], labels[a:b], lengths[a:b],
                                                        None if tool_calls is None else tool_calls[a:b])
                                     for actor, a, b in zip(self.actors, bounds, bounds[1:], strict=False)]

    def collect(self, pending: tuple[float, list[Any]]) -> ScoreResult:
        """The parts in order as one result; a scorer that does not answer within the phase's time, or is lost,
        ends the run in one sentence naming it (and its node)."""
        import ray
        from ray.exceptions import RayActorError

        from mindrl.workers.group import RESUME, PhaseTimeout, WorkerLost, death, lost_node, members, time_left

        start, refs = pending
        _, late = ray.wait(refs, num_returns=len(refs), timeout=time_left(start, self.phase_timeout_s))
        if late:
            self.stuck = {refs.index(ref) for ref in late}
            nodes = list(dict.fromkeys(self.nodes[i] for i in sorted(self.stuck)))
            raise PhaseTimeout(f"{members('rule-reward', 'scorer', sorted(self.stuck), len(self.actors))} on "
                               f"node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)} did not finish the "
                               f"rule_reward phase within "
                               f"{self.phase_timeout_s:g} s (rl_config.phase_timeout): the scorer or its verifier "
                               f"processes stopped answering; the run stops — {RESUME}, or raise "
                               f"rl_config.phase_timeout if scoring is only slow.")
        parts = []
        for i, ref in enumerate(refs):
            try:
                parts.append(ray.get(ref))
            except RayActorError as err:
                self.stuck = {i}  # gone: nothing to close
                raise lost_node(self.node_ids[i], err) or WorkerLost(
                    f"rule-reward scorer {i} of {len(self.actors)} on node {self.nodes[i]} died "
                    f"({death(err)}); the run stops — {RESUME}.") from None
        return ScoreResult.concatenate(parts)

    def close(self) -> None:
        """Let the scorers stop their verifier processes, then end them; bounded like a worker group's close."""
        from mindrl.workers.group import end_actors

        end_actors(self.actors, self.stuck, bool(self.stuck), 60.0, "rule-reward", "scorer")


class Rewards:
    """The run's reward sources (rule verifiers, a reward model, or both) as one: `submit` starts both,
    `collect` adds the reward model's weighted, normalised score to the verifiers' weighted total."""

    def __init__(self, rule: RuleRewards | None, model: RewardModelGroup | None, model_weight: float = 1.0,
                 normalize: str = "none", group_size: int = 1) -> None:
        self.rule, self.model = rule, model
        self.model_weight, self.normalize, self.group_size = model_weight, normalize, group_size
        self.stats = RunningStats()

    def submit(self, texts: list[str], labels: list[str], batch: dict[str, torch.Tensor],
               tool_calls: list[int] | None = None) -> tuple[Any, Any]:
        """Start scoring `batch`'s rows (tokens, prompt_lengths, response_lengths) and their decoded responses;
        `tool_calls`, each row's number of tool calls in a multi-turn rollout, goes to the verifiers that declare
        it (None for a single-turn one)."""
        lengths = batch["response_lengths"]
        rule = self.rule.submit(texts, labels, lengths.tolist(), tool_calls) if self.rule else None
        model = self.model.submit(batch["tokens"], batch["prompt_lengths"], lengths) if self.model else None
        return rule, model

    def collect(self, pending: tuple[Any, Any], timer: StepTimer | None = None, training: bool = True) -> ScoreResult:
        """Wait for the scores; `training` false (validation) takes the raw reward-model score."""
        rule, model = pending
        result = None
        if rule is not None:
            with timer("rule_reward") if timer else nullcontext():
                result = self.rule.collect(rule)
        if model is None:
            return result
        raw, seconds = self.model.collect(model)
        if timer:
            timer.seconds["reward_model"] = timer.seconds.get("reward_model", 0.0) + seconds
        scores = normalise(raw, self.normalize if training else "none", self.group_size, self.stats).tolist()
        if result is None:
            result = ScoreResult([0.0] * len(scores), {})
        result.rewards = [r + self.model_weight * s for r, s in zip(result.rewards, scores, strict=True)]
        result.scores[REWARD_MODEL] = scores
        result.metrics.update({"reward_model/mean": raw.double().mean().item(),
                               "reward_model/std": raw.double().std(unbiased=False).item()})
        return result

    def close(self) -> None:
        for source in (self.rule, self.model):
            if source is not None:
                source.close()
