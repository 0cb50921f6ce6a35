"""Multi-turn rollouts: the model calls tools between turns, token in and token out.

Each turn is one batched `generate` over the samples still running, so samples never wait for each
other one by one. A turn ends at the template's end of turn; the loop reads the turn's calls from its
text, runs them, and appends the tool turn as token ids: the template's fixed pieces each tokenized once
on their own, and each tool result tokenized on its own (special-token text in a result stays text, so a
tool cannot end a turn). The model's own tokens are never decoded and encoded again: re-tokenizing a
trajectory moves BPE boundaries and the trained ids drift from the sampled ones (verl RFC 6719).

A trajectory ends when a turn makes no call, when it is cut at max_tokens, when it calls again after
max_tool_calls calls have run (calls past the quota within a turn are answered as not run), or when the next
tool turn would leave the model no room in max_total_response_length or the engine's max_model_len; its last
turn is always the model's, so the outcome reward lands on a model token.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from mindrl.config.errors import ConfigError
from mindrl.data.images import PromptImages
from mindrl.data.readers import read_columns
from mindrl.data.templates import ToolTurn, announced_tools
from mindrl.rollout.base import LENGTH, STOP, RolloutEngine, RolloutResult, ToolStats
from mindrl.rollout.config import MultiTurnConfig, SamplingConfig
from mindrl.rollout.tool_parser import get_parser
from mindrl.tools import ToolBox, ToolCall, ToolResult, check_sandbox, load_toolbox

T = TypeVar("T")
#: turn k of a seeded rollout draws with seed + k · this, clear of the seeds its other turns' samples use
TURN_SEED_STRIDE = 1 << 24


@dataclass(frozen=True)
class AgentSpec:
    """What the ranks need to build an agent loop: the limits, the tokenizer, and the template's tool turn as text
    (mindrl.data.templates.Template.tool_turn)."""

    cfg: MultiTurnConfig
    tokenizer_path: str
    tool_turn: ToolTurn

    def __post_init__(self) -> None:
        if self.cfg.max_parallel_calls > 1 and self.tool_turn.separator is None:
            raise ConfigError(f"max_parallel_calls={self.cfg.max_parallel_calls} lets a turn's results share one tool "
                              f"turn, but the data's template has no format_observation_separator to set them apart "
                              f"as its chat format does; add one to the template or set max_parallel_calls: 1.")


class ToolTurns:
    """The tool turn as token ids, and a model turn's calls."""

    def __init__(self, tokenizer: Any, tool_turn: ToolTurn, parser: str) -> None:
        self.tokenizer = tokenizer
        self.after, self.opening, self.closing = (self._fixed(text) for text in
                                                  (tool_turn.after, tool_turn.opening, tool_turn.closing))
        #: between two results of one turn: each its own block, as the chat template writes several tool messages; a
        #: template without one runs one call a turn (AgentSpec), and the notes of calls not run follow on new lines
        self.separator = self._fixed("\n" if tool_turn.separator is None else tool_turn.separator)
        self.parse = get_parser(parser)

    def _fixed(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def ids(self, results: Sequence[ToolResult]) -> list[int]:
        """After the model's end of turn: the tool turn holding `results`, up to the model's next turn."""
        ids = self.after + self.opening
        for i, result in enumerate(results):
            if i:
                ids = ids + self.separator
            ids = ids + self.tokenizer.encode(result.text, add_special_tokens=False, split_special_tokens=True)
        return ids + self.closing

    def calls(self, turn: Sequence[int]) -> list[ToolCall]:
        return self.parse(self.tokenizer.decode(list(turn), skip_special_tokens=False))


def check_tools(cfg: MultiTurnConfig) -> str | None:
    """What the ranks will build, built once before anything starts: the parser, the tools (a custom tool's
    signature checked), and the sandbox started, so a problem is one sentence here and not in the first rollout.
    Returns a warning where a turn's calls may hold more memory than this machine has."""
    get_parser(cfg.tool_parser_format)
    with open_tools(cfg) as tools:
        footprint = tools.footprint_bytes
    check_sandbox()
    machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if footprint <= machine:
        return None
    return (f"max_parallel_calls={cfg.max_parallel_calls} sandboxed calls may hold {footprint >> 20} MB together "
            f"(memory_mb + 3 × disk_mb each), more than this machine's {machine >> 20} MB, in every rollout process "
            f"that runs tools; lower max_parallel_calls or the python tool's memory_mb.")


def open_tools(cfg: MultiTurnConfig) -> ToolBox:
    """The ToolBox a rollout with `cfg` runs its calls in."""
    return load_toolbox(cfg.tool_config_path, cfg.max_parallel_calls, cfg.max_tool_response_length,
                        cfg.tool_response_truncate_side)


def check_data_announces(data_file: Path, cfg: MultiTurnConfig) -> str | None:
    """`check_announced` for the prompts of a preprocessed parquet and the tools `cfg` runs."""
    with open_tools(cfg) as tools:
        schemas = tools.schemas()
    return check_announced(read_columns(data_file, ("prompt",))["prompt"], schemas, str(data_file))


def check_announced(prompts: Sequence[str], tools: Sequence[dict], where: str) -> str | None:
    """Prompts that announce tools (the template's tools block) must announce the ones the rollout runs, by name and
    arguments: a tool renamed or added in tool_config_path would otherwise fail every call as unknown, unnoticed.
    Returns a warning when no prompt announces any (the model then knows the tools only from its training)."""
    runs = _signatures(tools)
    silent = 0
    for row, text in enumerate(prompts):
        announced = announced_tools(text)
        if announced is None:
            silent += 1
            continue
        told = _signatures(announced)
        if told == runs:
            continue
        if set(told) != set(runs):
            differ = f"announces the tools {sorted(told)} but the rollout runs {sorted(runs)}"
        else:
            name = next(name for name in runs if told[name] != runs[name])
            differ = (f"announces tool {name!r} with the arguments {list(told[name])} but the rollout's takes "
                      f"{list(runs[name])}")
        raise ConfigError(f"prompt {row} of {where} {differ}; preprocess the data with the run's tool_config_path "
                          f"(cli/preprocess_data.py, key tool_config_path) or point rl_config.tool_config_path at "
                          f"the tools the prompts announce.")
    if silent == len(prompts):
        return (f"the prompts of {where} announce no tools, so the model knows the tools {sorted(runs)} only from "
                f"its training; preprocess with tool_config_path to announce them in the template's tools block.")
    if silent:
        raise ConfigError(f"{silent} of the {len(prompts)} prompts of {where} announce no tools while the others do; "
                          f"preprocess the data again with one tool_config_path.")
    return None


def _signatures(tools: Sequence[dict]) -> dict[str, tuple[str, ...]]:
    """Each tool's name → its arguments (a schema given whole or as its function part)."""
    out = {}
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        out[str(function.get("name"))] = tuple(sorted(properties))
    return out


def not_run(call: ToolCall, why: str) -> ToolResult:
    name = call.name or "the malformed call"
    return ToolResult(f"error: {name} was not run: {why}.", "error", 0.0)


def run_here(make: Callable[[], T]) -> T:
    """Tools run in this process (an engine alone on its ranks); a group of ranks runs them once and shares them."""
    return make()


class AgentLoop:
    """Drives one engine turn by turn; `share` runs a turn's tools once for the ranks that drive one engine
    together (they must feed it the same ids) and hands every rank the results."""

    def __init__(self, engine: RolloutEngine, tools: ToolBox, turns: ToolTurns, cfg: MultiTurnConfig,
                 max_model_len: int, share: Callable[[Callable[[], list[ToolResult]]], list[ToolResult]] = run_here
                 ) -> None:
        self.engine, self.tools, self.turns, self.cfg, self.share = engine, tools, turns, cfg, share
        self.max_model_len = max_model_len
        #: seconds the last `generate` spent running tools
        self.tool_seconds = 0.0

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, n: int = 1,
                 images: list[PromptImages | None] | None = None) -> RolloutResult:
        """`n` trajectories for each prompt, the n of a prompt next to each other (as RolloutEngine.generate)."""
        cfg, rows = self.cfg, len(prompts) * n
        prompt_of = [row // n for row in range(rows)]
        responses: list[list[int]] = [[] for _ in range(rows)]
        masks: list[list[int]] = [[] for _ in range(rows)]
        log_probs: list[list[float]] = [[] for _ in range(rows)]
        statuses: list[list[str]] = [[] for _ in range(rows)]
        turns, finish = [0] * rows, [STOP] * rows
        self.tool_seconds, active = 0.0, list(range(rows))
        #: tokens each response may reach: the trajectory's budget, within the engine's context after its prompt
        room = [min(cfg.max_total_response_length, self.max_model_len - len(prompts[row // n])) for row in range(rows)]
        out = self.engine.generate(prompts, sampling, n, images,
                                   max_tokens=[min(sampling.max_tokens, room[i * n]) for i in range(len(prompts))])
        for turn in itertools.count(1):  # each turn that goes on runs a call: at most max_tool_calls + 1 turns
            asking: list[tuple[int, list[ToolCall]]] = []
            for row, ids, lps, reason in zip(active, out.responses, out.log_probs, out.finish_reasons, strict=True):
                responses[row] += ids
                masks[row] += [1] * len(ids)
                log_probs[row] += lps
                turns[row] += 1
                finish[row] = reason
                calls = self.turns.calls(ids) if reason == STOP else []
                if calls and len(statuses[row]) < cfg.max_tool_calls:
                    asking.append((row, calls))
            active = self._answer(asking, responses, masks, log_probs, statuses, finish, room)
            if not active:
                break
            budgets = [min(sampling.max_tokens, room[row] - len(responses[row])) for row in active]
            seeded = sampling if sampling.seed is None else dataclasses.replace(
                sampling, seed=sampling.seed + turn * TURN_SEED_STRIDE)
            out = self.engine.generate([prompts[prompt_of[row]] + responses[row] for row in active], seeded, 1,
                                       [images[prompt_of[row]] for row in active] if images else None,
                                       max_tokens=budgets)
        return RolloutResult(responses, log_probs, finish, response_masks=masks,
                             tool_stats=[ToolStats(t, tuple(s)) for t, s in zip(turns, statuses, strict=True)])

    def _answer(self, asking: list[tuple[int, list[ToolCall]]], responses: list[list[int]],
                masks: list[list[int]], log_probs: list[list[float]], statuses: list[list[str]],
                finish: list[str], room: list[int]) -> list[int]:
        """Run the calls of every sample that asked (all at once: the pool overlaps them), append each sample's
        tool turn, and return the samples that go on."""
        cfg, plans = self.cfg, []
        for row, calls in asking:
            allowed = min(cfg.max_parallel_calls, cfg.max_tool_calls - len(statuses[row]))
            plans.append((row, calls[:allowed], calls[allowed:]))
        start = time.perf_counter()
        results = iter(self.share(lambda: self.tools.run([call for _, run, _ in plans for call in run])))
        self.tool_seconds += time.perf_counter() - start
        going = []
        for row, run, refused in plans:
            # the answer's quota first: where both ran out, a later turn could not run the call either
            why = (f"this answer has used its {cfg.max_tool_calls} tool calls"
                   if len(statuses[row]) + len(run) >= cfg.max_tool_calls
                   else f"at most {cfg.max_parallel_calls} calls run per turn")
            answered = [next(results) for _ in run] + [not_run(call, why) for call in refused]
            statuses[row] += [result.status for result in answered[:len(run)]]
            ids = self.turns.ids(answered)
            if len(responses[row]) + len(ids) >= room[row]:
                finish[row] = LENGTH  # no room left for the model to read the results and answer
                continue
            responses[row] += ids
            masks[row] += [0] * len(ids)
            log_probs[row] += [0.0] * len(ids)
            going.append(row)
        return going
