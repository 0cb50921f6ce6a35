"""The one rollout interface every backend implements.

Prompts go in as token ids (the data pipeline tokenized them with the chat template), so no
engine needs a tokenizer; responses come out as token ids, with the engine's log-prob of
every sampled token under the distribution it sampled from (logits / temperature, then
top-k / top-p / min-p truncation, renormalised: vLLM's "processed_logprobs"; with those
filters off it is the actor's log_softmax(logits / temperature)) and why each response
ended. The n samples of a prompt are contiguous: sample j of prompt i is at index i * n + j.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from mindrl.data.images import PromptImages
from mindrl.rollout.config import SamplingConfig

STOP, LENGTH = "stop", "length"


@dataclass
class RolloutResult:
    """len(prompts) × n responses, the n samples of each prompt next to each other."""

    responses: list[list[int]]
    #: log π_engine(token) of each response token, same lengths as `responses`
    log_probs: list[list[float]]
    #: "stop" (an end-of-sequence token, kept as the response's last token) or "length" (max_tokens reached)
    finish_reasons: list[str]
    #: with routes recorded (a mixture of experts' rollout routing replay): per response, the experts each token
    #: the engine fed was routed to, [len(prompt) + len(response) − 1, layers, top-k]; the last response token is
    #: never fed
    routes: list[torch.Tensor] | None = None
    #: a multi-turn rollout's (mindrl/rollout/agent_loop.py): per response, 1 where the model sampled the token and 0
    #: where a tool turn put it (its log-prob is then 0.0); None: every token is the model's
    response_masks: list[list[int]] | None = None
    #: a multi-turn rollout's per-sample record: model turns, tool calls run, and each call's status
    tool_stats: list[ToolStats] | None = None

    def __post_init__(self) -> None:
        if not len(self.responses) == len(self.log_probs) == len(self.finish_reasons):
            raise ValueError("a rollout result needs one log-prob list and one finish reason per response.")

    @classmethod
    def joined(cls, parts: Sequence[RolloutResult]) -> RolloutResult:
        """The parts' samples in order, as one result."""
        def every(field: str) -> list | None:
            values = [getattr(part, field) for part in parts]
            return None if not values or any(v is None for v in values) else [x for v in values for x in v]

        return cls(every("responses") or [], every("log_probs") or [], every("finish_reasons") or [],
                   every("routes"), every("response_masks"), every("tool_stats"))


@dataclass(frozen=True)
class ToolStats:
    """One multi-turn sample: how many turns the model took, and the status of each tool call it made
    (mindrl.tools.ToolResult.status: ok, error, timeout, killed)."""

    turns: int
    statuses: tuple[str, ...] = ()

    @property
    def calls(self) -> int:
        return len(self.statuses)

    @property
    def ok_calls(self) -> int:
        """Calls that ran and answered: what a reward for calling counts (a malformed call must not earn it)."""
        return self.statuses.count("ok")


class RolloutEngine(ABC):
    """A generator of responses that takes the actor's weights in place."""

    #: which backend this is ("vllm" or "megatron"), for logs and metrics
    name: str
    #: True when the engine computes with the actor's own parameters, so a sync has nothing to move
    shares_actor_weights: bool = False

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, n: int = 1,
                 images: list[PromptImages | None] | None = None,
                 max_tokens: Sequence[int] | None = None) -> RolloutResult:
        """`n` samples for each prompt (token ids), at most `sampling.max_tokens` new tokens each (or, given
        `max_tokens`, that many for each prompt: a multi-turn rollout's samples have different budgets left). A
        vision-language model's prompts come with their images (one entry per prompt), each image's
        placeholder already expanded to its grid in the token ids."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take full (unsharded) HF-named tensors in place; may be called with the model in several
        parts. Cached prefixes computed with older weights are dropped by `finish_weight_update`."""

    def finish_weight_update(self) -> None:
        """Called once after the last `load_weights` of a sync: make the new weights the ones used."""

    def abort_weight_update(self) -> None:
        """A sync failed part way: the engine must not generate with what it has until the next sync."""

    def prompt_log_probs(self, sequences: list[list[int]],
                         images: list[PromptImages | None] | None = None) -> list[list[float]]:
        """log p(token t+1 | ≤ t) of each sequence at temperature 1: how a checked sync compares the
        engine's weights with the actor's. Engines that share the actor's weights need not check."""
        raise NotImplementedError(f"the {self.name} engine cannot score prompts")

    @property
    def holds_weights(self) -> bool:
        """Whether the engine holds the last weights synced into it: false before the first sync, after one that
        failed part way, and after a `release_memory` that dropped them — a sync must come before it generates."""
        return True

    def release_memory(self) -> None:
        """Free the engine's KV cache (and weights, where the backend can) while the actor trains."""

    def resume_weights(self) -> None:
        """Take back the memory of the weights `release_memory` freed, for the sync to fill."""

    def resume_memory(self) -> None:
        """Take back the rest of what `release_memory` freed (the KV cache), before generating: called once the
        actor's parameters are offloaded, so the engine's whole budget never sits beside them."""

    def close(self) -> None:
        """Free everything; the engine is unusable afterwards."""
