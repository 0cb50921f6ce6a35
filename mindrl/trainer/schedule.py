"""The asynchronous rollout's bookkeeping: the groups in flight, the policy version of every token, the bound.

Pure Python (no Ray, no engine), so its rules are tested alone over random generation times (tests/test_schedule.py);
mindrl/trainer/async_rollout.py drives the engines with it.

- A *version* is the actor's update count: the weights after update v are version v.
- A group is a prompt's n samples. It is *admitted* (its prompt taken from the loader) while no more than
  (version + max_staleness + 1) batches' worth of groups have been, dropped ones not counted (AReaL's
  max_head_offpolicyness rule): the rollout never runs further ahead than the bound lets it train.
- Each round generates one segment of every unfinished sample, at most ⌈max_tokens / partial_rollout_max_split⌉
  tokens (MindSpeed-RL's split), under the weights the engine then holds; every token keeps that version.
- Batches leave in the order of admission: batch v is the groups admitted v-th, trained at version v once all are
  finished (MindSpeed-RL's guarantee_order). With the admission rule, a group's oldest token is then never more than
  max_staleness versions behind its batch, however long its responses run: nothing waits past the bound, and a
  younger group that finished first never takes an older one's place and pushes it past it.
- A group's age is that of its *oldest* token (verl PR 7569: the last token says nothing of the first). A group
  whose oldest token is more than max_staleness versions behind the version being trained is dropped, finished or
  not, and never trained (`dropped` counts them): the guard for what the order above cannot promise, such as a
  checkpoint of another schedule. A group is trained at most once: it leaves with its batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mindrl.rollout.base import LENGTH, STOP, RolloutResult, ToolStats


@dataclass
class Sample:
    """One response in the making: its tokens so far, the engine's log-prob and the policy version of each."""

    response: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    #: 1 where the model sampled the token, 0 where a tool turn put it (multi-turn); None: every token is the model's
    mask: list[int] | None = None
    tool_stats: ToolStats | None = None
    #: STOP or LENGTH once the sample is done
    finish: str | None = None
    segments: int = 0

    @property
    def done(self) -> bool:
        return self.finish is not None


@dataclass
class Group:
    """A prompt's samples, from its admission to its batch."""

    #: the group's place in the order of admission (also the resume's key)
    index: int
    #: the prompt's row in the training data (mindrl.trainer.prompts.PromptLoader)
    row: int
    prompt: list[int]
    samples: list[Sample]

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)

    @property
    def oldest(self) -> int | None:
        """The version of the group's oldest token (None before its first segment)."""
        firsts = [s.versions[0] for s in self.samples if s.versions]
        return min(firsts) if firsts else None


@dataclass(frozen=True)
class Request:
    """One sample's next segment: the prompt and the response so far as the engine's prompt, and its budget."""

    group: int
    sample: int
    ids: list[int]
    max_tokens: int


class Schedule:
    def __init__(self, n: int, batch_groups: int, max_tokens: int, max_staleness: int, max_split: int = 1) -> None:
        if max_staleness < 0 or max_split < 1:
            raise ValueError(f"max_staleness must be >= 0 and max_split >= 1, got {max_staleness}, {max_split}.")
        self.n, self.batch_groups, self.max_tokens = n, batch_groups, max_tokens
        self.max_staleness, self.max_split = max_staleness, max_split
        self.chunk = math.ceil(max_tokens / max_split)
        self.groups: dict[int, Group] = {}
        #: groups admitted since the run started, and dropped for staleness
        self.admitted = self.dropped = 0
        #: samples and tokens dropped, for the metrics
        self.dropped_tokens = 0

    # ------------------------------------------------------------------ admission
    def room(self, version: int) -> int:
        """How many groups may be admitted now that the weights are `version`."""
        return max(0, (version + self.max_staleness + 1) * self.batch_groups + self.dropped - self.admitted)

    def admit(self, rows: Iterable[tuple[int, list[int]]]) -> None:
        """New groups for (data row, prompt ids) in loader order."""
        for row, prompt in rows:
            self.groups[self.admitted] = Group(self.admitted, row, list(prompt),
                                               [Sample() for _ in range(self.n)])
            self.admitted += 1

    # ------------------------------------------------------------------ rounds
    def requests(self) -> list[Request]:
        """The next segment of every unfinished sample, oldest group first."""
        return [Request(group.index, j, group.prompt + sample.response,
                        min(self.chunk, self.max_tokens - len(sample.response)))
                for group in self.groups.values() for j, sample in enumerate(group.samples) if not sample.done]

    def add(self, requests: list[Request], result: RolloutResult, engine_version: int) -> None:
        """A round's segments, generated by weights `engine_version`; those of groups dropped meanwhile are let go."""
        for i, request in enumerate(requests):
            group = self.groups.get(request.group)
            if group is None:  # dropped while its segment was generating: the segment is dropped with it
                self.dropped_tokens += len(result.responses[i])
                continue
            sample = group.samples[request.sample]
            tokens = result.responses[i]
            sample.response += tokens
            sample.log_probs += result.log_probs[i]
            sample.versions += [engine_version] * len(tokens)
            if result.response_masks is not None:
                sample.mask = (sample.mask or []) + result.response_masks[i]
            if result.tool_stats is not None:
                sample.tool_stats = add_stats(sample.tool_stats, result.tool_stats[i])
            sample.segments += 1
            if result.finish_reasons[i] == STOP:
                sample.finish = STOP
            elif len(sample.response) >= self.max_tokens or len(tokens) < request.max_tokens:
                # the whole budget is spent, or the engine stopped short of the segment's (its context is full)
                sample.finish = LENGTH

    # ------------------------------------------------------------------ batches

    def drop_stale(self, version: int) -> None:
        """Drop the groups whose oldest token is too old to train at `version`."""
        stale = [g for g in self.groups.values() if g.oldest is not None and version - g.oldest > self.max_staleness]
        for group in stale:
            del self.groups[group.index]
            self.dropped_tokens += sum(len(s.response) for s in group.samples)
        self.dropped += len(stale)

    def take(self, version: int) -> list[Group] | None:
        """A batch to train at `version`: the first `batch_groups` groups in admission order, or None while one of
        them is unfinished (or not admitted yet). Stale groups are dropped first."""
        self.drop_stale(version)
        head = list(self.groups.values())[:self.batch_groups]
        if len(head) < self.batch_groups or not all(g.done for g in head):
            return None
        for group in head:
            del self.groups[group.index]
        return head

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain lists and numbers (a checkpoint's extra is loaded without running code)."""
        def sample(s: Sample) -> dict[str, Any]:
            stats = None if s.tool_stats is None else [s.tool_stats.turns, list(s.tool_stats.statuses)]
            return {"response": s.response, "log_probs": s.log_probs, "versions": s.versions, "mask": s.mask,
                    "tool_stats": stats, "finish": s.finish, "segments": s.segments}

        return {"n": self.n, "batch_groups": self.batch_groups,
                "admitted": self.admitted, "dropped": self.dropped, "dropped_tokens": self.dropped_tokens,
                "groups": [{"index": g.index, "row": g.row, "prompt": g.prompt,
                            "samples": [sample(s) for s in g.samples]} for g in self.groups.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.admitted, self.dropped = int(state["admitted"]), int(state["dropped"])
        self.dropped_tokens = int(state["dropped_tokens"])
        self.groups = {}
        for g in state["groups"]:
            samples = []
            for s in g["samples"]:
                stats = None if s["tool_stats"] is None else ToolStats(s["tool_stats"][0], tuple(s["tool_stats"][1]))
                samples.append(Sample(list(s["response"]), list(s["log_probs"]), list(s["versions"]), s["mask"],
                                      stats, s["finish"], int(s["segments"])))
            self.groups[int(g["index"])] = Group(int(g["index"]), int(g["row"]), list(g["prompt"]), samples)


def add_stats(so_far: ToolStats | None, segment: ToolStats) -> ToolStats:
    """A sample's tool turns and calls over its segments."""
    if so_far is None:
        return segment
    return ToolStats(so_far.turns + segment.turns, so_far.statuses + segment.statuses)


def saved_shape(state: dict[str, Any], iteration: int) -> tuple[int, int]:
    """(samples per group, groups per batch) of a saved schedule `iteration` batches in. Checkpoints written before
    the shape was saved give it by their counts: every admission was a whole batch, and the groups admitted are
    those trained, dropped and still buffered."""
    if "batch_groups" in state:
        return int(state["n"]), int(state["batch_groups"])
    groups = state["groups"]
    n = len(groups[0]["samples"]) if groups else 0
    trained = int(state["admitted"]) - int(state["dropped"]) - len(groups)
    return n, trained // iteration if iteration else 0


def buffered_rows(state: dict[str, Any]) -> list[int]:
    """The data rows of a saved schedule's buffered groups, in the order they were admitted."""
    return [int(g["row"]) for g in sorted(state["groups"], key=lambda g: int(g["index"]))]


def batch_of(groups: list[Group]) -> tuple[list[list[int]], RolloutResult, list[list[int]]]:
    """The groups as the synchronous rollout hands them on: prompts, a RolloutResult (sample j of prompt i at
    i·n + j) and each response token's policy version."""
    samples = [s for g in groups for s in g.samples]
    masks = [s.mask for s in samples]
    stats = [s.tool_stats for s in samples]
    result = RolloutResult([s.response for s in samples], [s.log_probs for s in samples],
                           [s.finish for s in samples], None,
                           masks if all(m is not None for m in masks) else None,
                           stats if all(t is not None for t in stats) else None)
    return [g.prompt for g in groups], result, [s.versions for s in samples]
