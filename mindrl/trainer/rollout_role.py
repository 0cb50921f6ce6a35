"""The driver's handle on rollout engines that run on ranks of their own (mindrl/workers/rollout_rank.py).

It starts the rollout ranks, joins them and the actor's ranks in the push group, and then offers what an
asynchronous schedule needs: push the actor's weights as a policy version, start a generation and collect it
later (the actor trains meanwhile), and check that the engines score a probe sequence as the actor does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from mindrl.config.resources import RoleResource
from mindrl.data.images import PromptImages
from mindrl.models.dtypes import ENGINE_DTYPES
from mindrl.rollout.base import RolloutResult
from mindrl.rollout.config import SamplingConfig
from mindrl.workers.engine_share import probe_failure
from mindrl.workers.group import COLLECTIVE_TIMEOUT_S, WorkerGroup, gather_rows
from mindrl.workers.rollout_rank import RolloutRank, RolloutSpec


@dataclass(frozen=True)
class Pending:
    """A generation under way: its ranks' results, and when it started (for the phase timeout)."""

    refs: list[Any]
    since: float


class RolloutRole:
    """The rollout ranks, and their push group with the actor's `actor` group (whose ranks were set up with
    PolicySpec.rollout_elsewhere; `actor_dp_size` is what their setup returned)."""

    def __init__(self, actor: WorkerGroup, actor_dp_size: int, spec: RolloutSpec, resource: RoleResource,
                 phase_timeout_s: float = 0.0, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        self.actor, self.actor_dp_size, self.spec = actor, actor_dp_size, spec
        self.dtype = ENGINE_DTYPES[spec.generate.dtype]
        self.group = WorkerGroup("rollout", RolloutRank, resource, phase_timeout_s=phase_timeout_s)
        try:
            host, port = self.group.rendezvous(timeout_s)
            #: vLLM engines the rollout ranks form
            self.engines: int = self.group.call("setup", host, port, spec, timeout_s)[0]["engines"]
            self._join_push(timeout_s)
        except BaseException:
            self.group.kill()
            raise

    def _join_push(self, timeout_s: float) -> None:
        """Actor rank 0 serves the push group's store; the actor's ranks are its first members, the rollout ranks
        the rest; every member joins at once (the group forms only when all have)."""
        actors, rollouts = self.actor.actors, self.group.actors
        world = len(actors) + len(rollouts)
        loopback = len(set(self.actor.nodes) | set(self.group.nodes)) == 1
        host, port = self.actor.wait([actors[0].serve_push.remote(world, loopback, timeout_s)])[0]
        joining = [actor.join_push.remote(host, port, world, rank, len(actors), timeout_s)
                   for rank, actor in enumerate(actors)]
        receiving = [rank.join_push.remote(host, port, world, len(actors) + i, len(actors), timeout_s)
                     for i, rank in enumerate(rollouts)]
        self.actor.wait(joining)
        self.group.wait(receiving)

    def push(self, version: int) -> dict[str, float]:
        """The actor's current weights into every engine, as policy `version` (the actor's update count), which
        every later generate reports (`rollout/weight_version`); the push's metrics (`sync/…`)."""
        start = time.perf_counter()
        sending = self.actor.call_async("push_weights", version)
        receiving = self.group.call_async("receive_weights", version)
        sent = self.actor.wait(sending, "weight push", start)[0]
        received = self.group.wait(receiving, "weight push", start)[0]
        return {**sent, **received, "sync/push_seconds": time.perf_counter() - start}

    def generate_async(self, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                       images: list[PromptImages | None] | None = None,
                       max_tokens: list[int] | None = None) -> Pending:
        """Start generating (RolloutRank.generate); `wait` collects it."""
        return Pending(self.group.call_async("generate", prompts, n, sampling, images, max_tokens),
                       time.perf_counter())

    def wait(self, pending: Pending) -> tuple[RolloutResult, dict[str, float]]:
        """The generation's whole result and metrics, `rollout/weight_version` the policy version that made it."""
        return self.group.wait(pending.refs, "rollout", pending.since)[0]

    def probe(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the actor's, each rollout rank's engine's) log-probs of the probe sequence, [rows, length − 1] each:
        log p(token t+1 | ≤ t) at temperature 1."""
        rows = self.actor_dp_size
        actor = gather_rows(self.actor.call("probe_log_probs", rows), rows)[:, :-1]
        return actor, self.group.call("probe_log_probs", rows)

    def check(self) -> dict[str, float]:
        """How far the engines' probe log-probs are from the actor's (`sync/probe_max_abs_diff`); with
        generate_config.check_weight_sync, past the engine dtype's tolerance the engines refuse to generate until
        the next push and WeightSyncError says so."""
        actor, engines = self.probe()
        # every rank's engine: one that missed the push must not hide behind another that took it
        worst = max((actor - engine).abs().max().item() for engine in engines)
        if self.spec.generate.check_weight_sync:
            failure = probe_failure(worst, self.dtype)
            if failure is not None:
                self.group.call("reject_weights")
                raise failure
        return {"sync/probe_max_abs_diff": worst}

    def kill(self) -> None:
        self.group.kill()
