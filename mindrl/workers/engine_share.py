"""What every host of rollout engines does, in the actor's ranks (colocated.py) or in ranks of their own
(rollout_rank.py): split a batch's prompts between the engines and gather the whole result on every rank, build
the agent loop around an engine, and judge a sync by the log-probs of a probe sequence. One place each, so the
two placements cannot drift apart in how they seed, split or check.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from mindrl.config import ModelArch
from mindrl.data.images import PromptImages
from mindrl.rollout.agent_loop import AgentLoop, AgentSpec, ToolTurns, open_tools, run_here
from mindrl.rollout.base import RolloutEngine, RolloutResult
from mindrl.rollout.config import GenerateConfig, SamplingConfig
from mindrl.rollout.weight_sync import WeightSyncError

if TYPE_CHECKING:
    from mindrl.workers.megatron_worker import ActorWorker

T = TypeVar("T")
#: largest |engine − actor| log-prob on the probe sequence a checked sync accepts, by engine dtype
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.1}


def engine_config(cfg: GenerateConfig, actor: ActorWorker) -> GenerateConfig:
    """`cfg` with its engine dtype resolved: `auto` is the actor's training precision."""
    return cfg.engine_dtype(actor.model.config.params_dtype == torch.bfloat16)


def engine_group(infer_tp: int) -> tuple[int, int]:
    """(this rank's engine, number of engines) for vLLM engines of `infer_tp` consecutive ranks of the default
    world each."""
    return dist.get_rank() // infer_tp, dist.get_world_size() // infer_tp


def generate_share(generator: RolloutEngine | AgentLoop, group: int, groups: int, prompts: list[list[int]], n: int,
                   sampling: SamplingConfig, images: list[PromptImages | None] | None = None,
                   max_tokens: list[int] | None = None) -> RolloutResult:
    """The whole batch's responses on every rank of the default world (collective): engine `group` of `groups`
    generates its contiguous share of the prompts, sample r of the batch drawing with seed + r whichever engine
    has it, so the result does not depend on how many engines there are. `max_tokens` (one per prompt) continues
    partial responses: each prompt then holds its response so far and gets the tokens it has left."""
    if max_tokens is not None and len(max_tokens) != len(prompts):
        raise ValueError(f"{len(max_tokens)} max_tokens for {len(prompts)} prompts; give one per prompt.")
    if max_tokens is not None and isinstance(generator, AgentLoop):
        raise ValueError("per-prompt max_tokens continue single-turn responses; a multi-turn rollout budgets each "
                         "turn itself, so generate without them.")
    bounds = [len(prompts) * g // groups for g in range(groups + 1)]
    if sampling.seed is not None:
        sampling = dataclasses.replace(sampling, seed=sampling.seed + bounds[group] * n)
    mine = slice(bounds[group], bounds[group + 1])
    own_images = images[mine] if images else None
    if max_tokens is None:
        share = generator.generate(prompts[mine], sampling, n, own_images)
    else:
        share = generator.generate(prompts[mine], sampling, n, own_images, max_tokens=max_tokens[mine])
    shares: list[tuple[int, RolloutResult] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, (group, share))
    by_group: dict[int, RolloutResult] = {}
    for index, result in shares:  # every rank of a group holds the same result: keep the first
        by_group.setdefault(index, result)
    return RolloutResult.joined([by_group[g] for g in range(groups)])


def timed_share(generator: RolloutEngine | AgentLoop, group: int, groups: int, prompts: list[list[int]], n: int,
                sampling: SamplingConfig, images: list[PromptImages | None] | None = None,
                max_tokens: list[int] | None = None) -> tuple[RolloutResult, dict[str, float]]:
    """`generate_share`, with the seconds it took, the tokens it made and, through an agent loop, the seconds its
    tools ran."""
    start = time.perf_counter()
    result = generate_share(generator, group, groups, prompts, n, sampling, images, max_tokens)
    metrics = {"rollout/generate_seconds": time.perf_counter() - start,
               "rollout/response_tokens": float(sum(len(r) for r in result.responses))}
    if isinstance(generator, AgentLoop):
        metrics["rollout/tool_seconds"] = generator.tool_seconds
    return result, metrics


def close_engine(engine: RolloutEngine, agent: AgentLoop | None) -> None:
    """End the agent loop's tool pool, then the engine, even when the first fails."""
    try:
        if agent is not None:
            agent.tools.close()
    finally:
        engine.close()


def build_agent_loop(engine: RolloutEngine, spec: AgentSpec, group: int, arch: ModelArch,
                     max_model_len: int) -> AgentLoop:
    """The loop around this rank's engine (engine `group`); the ranks of one engine share a gloo group through
    which the first of them hands the others each turn's tool results (collective over the default world: every
    rank builds one)."""
    from mindrl.data.tokenizer import load_tokenizer

    members: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(members, group)
    share, mine = run_here, [rank for rank, g in enumerate(members) if g == group]
    for g in dict.fromkeys(members):  # every rank creates every group, in the same order
        ranks = [rank for rank, other in enumerate(members) if other == g]
        handle = dist.new_group(ranks, backend="gloo") if len(ranks) > 1 else None
        if g == group and handle is not None:
            share = _shared_from(mine[0], handle)
    cfg = spec.cfg
    tools = open_tools(cfg)
    turns = ToolTurns(load_tokenizer(spec.tokenizer_path, arch), spec.tool_turn, cfg.tool_parser_format)
    return AgentLoop(engine, tools, turns, cfg, max_model_len, share)


def _shared_from(leader: int, group: Any) -> Callable[[Callable[[], T]], T]:
    """Run on `leader` (a global rank), broadcast over `group` to its other ranks."""
    def share(make: Callable[[], T]) -> T:
        box = [make() if dist.get_rank() == leader else None]
        dist.broadcast_object_list(box, src=leader, group=group)
        return box[0]

    return share


def probe_tokens(vocab: int, rows: int, length: int = 24) -> torch.Tensor:
    """A fixed sequence per data-parallel rank of the actor, spread over the whole vocabulary."""
    positions = torch.arange(rows * length, dtype=torch.int64).view(rows, length)
    return (positions * 7919 + 13) % vocab


def probe_failure(worst: float, dtype: torch.dtype, differing: Sequence[str] = ()) -> WeightSyncError | None:
    """The error a checked sync raises (after making its engine refuse to generate), or None when the engine's
    probe log-probs are within the dtype's tolerance of the actor's and every rank's engine got the same bytes."""
    if not differing and worst <= PROBE_TOLERANCE[dtype]:
        return None
    return WeightSyncError(
        f"weight sync check failed: {len(differing)} tensors differ between ranks' engines "
        f"(e.g. {list(differing[:3])}), probe log-probs differ from the actor's by up to {worst:.3g}; "
        f"the engine refuses to generate until the next complete sync.")
