"""Step metrics: MindSpeed-RL's names, the summaries behind them, and one sink for all outputs.

Names follow MindSpeed-RL so its users' dashboards and scripts keep working; docs/metrics.md
defines each. The sink writes every step to the console (a tqdm bar with ETA on a terminal; a plain
line now and then where the console is a file or a CI log, whose readers get no use of a redrawn bar),
to TensorBoard, to a jsonl file that a killed run keeps line by line, and to the experiment trackers the config
turns on (mindrl.trainer.tracking: Weights & Biases, SwanLab).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Protocol

import torch
from tqdm import tqdm

from mindrl.console import terminal_err

#: MindSpeed-RL's phases of one GRPO step (PPO adds values and update_critic), logged as timing/<phase> in seconds
TIMING_PHASES = ("all", "rollout", "old_log_p", "reference_model", "rule_reward", "adv", "update",
                 "resharding_to_infer", "resharding_to_train", "values", "update_critic")

#: the phases the rollout workers time themselves (around the engine's generation)
RESHARDING_PHASES = ("resharding_to_infer", "resharding_to_train")

#: which timing each throughput divides by
THROUGHPUT_TIMINGS = {"e2e_tps": "all", "update_tps": "update", "vllm_tps": "rollout"}

#: the actor's update metrics (mindrl.workers) under MindSpeed-RL's names
ACTOR_NAMES = {"pg_loss": "actor/pg_loss", "kl_loss": "actor/kl_loss", "entropy": "actor/entropy",
               "clip_fraction": "actor/pg_clipfrac", "dual_clip_fraction": "actor/pg_clipfrac_lower",
               "approx_kl_old": "actor/ppo_kl", "lr": "actor/lr", "grad_norm": "grad_norm"}

#: verifiers whose score is exactly 1.0 for a correct answer, in the order `accuracy` prefers them
ACCURACY_VERIFIERS = ("base_acc", "acc", "math_17k_acc", "acc_for_ppo", "acc_for_dapo", "math_verify_reward",
                      "retool_reward", "gsm8k", "geo3k_acc")

#: the per-step metrics file a run writes under its `save` folder
METRICS_FILE = "metrics.jsonl"
#: console postfix: metric → short label
POSTFIX = {"grpo/score/mean": "score", "accuracy": "acc", "response_length/mean": "len",
           "actor/pg_loss": "pg", "actor/kl_loss": "kl", "sft/loss": "loss", "dpo/loss": "loss",
           "rewards/accuracies": "pair_acc", "rewards/margins": "margin", "timing/all": "step_s"}
#: where the console is no terminal: a progress line at least every this many seconds,
PLAIN_PROGRESS_S = 30.0
#: and every 1/this of the run's steps
PLAIN_PROGRESS_LINES = 20


class StepTimer:
    """Seconds per phase of one step; a phase entered twice accumulates."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{phase}": value for phase, value in self.seconds.items()}


#: rollout metrics of a step's generation rounds (DAPO) that are not sums: the worst, and a rate recomputed
_ROUNDS_MAX = ("sync/probe_max_abs_diff",)
_ROUNDS_RATE = {"sync/gb_per_s": ("sync/gigabytes", "sync/seconds")}


def add_round(total: dict[str, float], round_metrics: Mapping[str, float]) -> None:
    """Fold one generation round's rollout metrics (seconds, tokens, bytes, counts) into the step's `total`:
    they add up, except a worst case (its max) and a rate (recomputed from the sums)."""
    for key, value in round_metrics.items():
        if key in _ROUNDS_MAX:
            total[key] = max(total.get(key, value), value)
        elif key not in _ROUNDS_RATE:
            total[key] = total.get(key, 0.0) + value
    for key, (amount, seconds) in _ROUNDS_RATE.items():
        if key in round_metrics:
            total[key] = total[amount] / total[seconds] if total[seconds] else 0.0


def _floats(values: torch.Tensor | Sequence[float]) -> torch.Tensor:
    tensor = torch.as_tensor(values, dtype=torch.float64).flatten()
    if tensor.numel() == 0:
        raise ValueError("metrics need at least one sample; got an empty batch.")
    return tensor


def throughput(prompt_lengths: torch.Tensor | Sequence[int], response_lengths: torch.Tensor | Sequence[int],
               world_size: int, seconds: float, use_max: bool = False) -> float:
    """Tokens per second per device: (prompt length + response length) × samples / world size / seconds.

    Samples are all responses of the step (global batch size × n). MindSpeed-RL's
    `log_max_throughput` takes the max lengths instead of the means (`use_max`), which
    counts the padded work a batched engine does rather than the useful tokens.
    """
    prompts, responses = _floats(prompt_lengths), _floats(response_lengths)
    if prompts.numel() != responses.numel():
        raise ValueError(f"{prompts.numel()} prompt lengths for {responses.numel()} responses; give one prompt "
                         f"length per response (repeat each prompt's n times).")
    if world_size < 1:
        raise ValueError(f"world_size must be a positive device count, got {world_size}.")
    if seconds <= 0:
        return math.nan
    reduce = torch.max if use_max else torch.mean
    tokens = (reduce(prompts) + reduce(responses)).item() * responses.numel()
    return tokens / world_size / seconds


def throughput_metrics(prompt_lengths: torch.Tensor | Sequence[int], response_lengths: torch.Tensor | Sequence[int],
                       devices: int, actor_devices: int, seconds: Mapping[str, float],
                       use_max: bool = False) -> dict[str, float]:
    """e2e_tps, update_tps and vllm_tps from a step's phase times (StepTimer.seconds), per device of all
    `devices` the run holds, and e2e_tps_per_actor_device, per device of the actor's `actor_devices`; a
    throughput whose phase was not timed is left out."""
    metrics = {name: throughput(prompt_lengths, response_lengths, devices, seconds[phase], use_max)
               for name, phase in THROUGHPUT_TIMINGS.items() if phase in seconds}
    if "all" in seconds:
        metrics["e2e_tps_per_actor_device"] = throughput(prompt_lengths, response_lengths, actor_devices,
                                                         seconds["all"], use_max)
    return metrics


def rollout_metrics(response_lengths: torch.Tensor | Sequence[int], max_response_length: int,
                    scores: torch.Tensor | Sequence[float],
                    verifier_scores: Mapping[str, torch.Tensor | Sequence[float]] | None = None,
                    accuracy_verifier: str | None = None) -> dict[str, float]:
    """Summaries of one step's responses: score, length, per-verifier means and accuracy.

    `scores` is each response's total reward (weighted verifiers + overlong penalty);
    `verifier_scores` the unweighted per-verifier scores. `accuracy` is the share of
    responses the accuracy verifier scores 1.0 (its "correct"), since a plain mean mixes in
    the −0.5 / −1.0 penalties some verifiers give; without `accuracy_verifier` the first
    of ACCURACY_VERIFIERS present is used, and no verifier of that kind means no accuracy.
    """
    lengths, totals = _floats(response_lengths), _floats(scores)
    metrics = {
        "grpo/score/mean": totals.mean().item(), "grpo/score/max": totals.max().item(),
        "grpo/score/min": totals.min().item(),
        "response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
        "response_length/min": lengths.min().item(),
        "response_length/clip_ratio": (lengths >= max_response_length).double().mean().item(),
    }
    per_verifier = {name: _floats(values) for name, values in (verifier_scores or {}).items()}
    for name, values in per_verifier.items():
        metrics[f"{name}_rewards/mean"] = values.mean().item()
    if accuracy_verifier is None:
        accuracy_verifier = next((name for name in ACCURACY_VERIFIERS if name in per_verifier), None)
    elif accuracy_verifier not in per_verifier:
        raise ValueError(f"accuracy verifier {accuracy_verifier!r} has no scores in this batch "
                         f"({', '.join(sorted(per_verifier)) or 'none'}); name one of them.")
    if accuracy_verifier is not None:
        metrics["accuracy"] = (per_verifier[accuracy_verifier] == 1.0).double().mean().item()
    return metrics


#: the batch's per-row multi-turn counts (mindrl.trainer.experience.tool_stats_batch)
TOOL_STATS = ("turns", "tool_calls", "tool_calls_ok", "tool_errors", "tool_stopped")


def multi_turn_metrics(batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Turns and tool calls of a multi-turn batch, taking its count rows out of it (the workers never need them);
    nothing for a single-turn batch."""
    if "turns" not in batch:
        return {}
    turns, calls, _, errors, stopped = (batch.pop(key).double() for key in TOOL_STATS)
    total = calls.sum().item()
    return {"multi_turn/turns_mean": turns.mean().item(), "multi_turn/tool_calls_mean": calls.mean().item(),
            "multi_turn/tool_call_share": (calls > 0).double().mean().item(),
            "multi_turn/call_error_share": errors.sum().item() / total if total else 0.0,
            "multi_turn/call_stopped_share": stopped.sum().item() / total if total else 0.0,
            "response_length/model_tokens_mean": batch["loss_mask"].sum(-1).double().mean().item()}


def actor_metrics(update: Mapping[str, float]) -> dict[str, float]:
    """The actor's update metrics renamed to MindSpeed-RL's; unknown ones go under actor/, except
    those already named in their own group (the engine gap the update measures, rollout_is/...)."""
    return {ACTOR_NAMES.get(key, key if "/" in key else f"actor/{key}"): float(value) for key, value in update.items()}


def _json_value(value: float) -> float | None:
    # JSON has no NaN/inf; null keeps every line parseable by strict readers.
    value = float(value)
    return value if math.isfinite(value) else None


class Tracker(Protocol):
    """An experiment tracker the sink feeds every step (mindrl.trainer.tracking); the sink closes it."""

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _read_kept_lines(path: Path, resume_iteration: int) -> list[str]:
    """Lines of steps ≤ `resume_iteration`; a line cut short by a kill is dropped too."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        if isinstance(step, int) and step <= resume_iteration:
            kept.append(line)
    return kept


class MetricsSink:
    """Console, TensorBoard, jsonl and tracker output of every step's metrics.

    Steps count from 1 and equal the checkpoint iteration reached after the step. On a
    resume from iteration k (`resume_iteration=k`; 0 for a fresh run) the jsonl keeps
    only the lines of steps ≤ k and TensorBoard purges events of steps > k, so steps
    that ran after the checkpoint and are now redone appear once, with the new values.
    A fresh run in an old directory therefore starts both files from scratch. The trackers
    open a new run per start, which cannot purge the old one: the kept steps are replayed
    into it first (a non-finite value, null in the jsonl, comes back as NaN).
    """

    def __init__(self, train_iters: int, jsonl_path: str | os.PathLike | None = None,
                 tensorboard_dir: str | os.PathLike | None = None, resume_iteration: int = 0,
                 console: bool = True, console_file: IO[str] | None = None,
                 trackers: Sequence[Tracker] = ()) -> None:
        if resume_iteration < 0 or resume_iteration > train_iters:
            raise ValueError(f"resume_iteration={resume_iteration} is outside 0..train_iters={train_iters}; resume "
                             f"from a checkpoint of this run or raise train_iters.")
        self.last_step = resume_iteration
        self._jsonl: IO[str] | None = None
        self._trackers = list(trackers)
        kept: list[str] = []
        if jsonl_path is not None:
            path = Path(jsonl_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = _read_kept_lines(path, resume_iteration) if path.exists() else []
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
            self._jsonl = path.open("a")
        for line in kept:
            record = json.loads(line)
            step = record.pop("step")
            for tracker in self._trackers:
                tracker.log(step, {key: math.nan if value is None else float(value) for key, value in record.items()})
        self._writer = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(tensorboard_dir), purge_step=resume_iteration + 1)
        self._console = (console_file or terminal_err()) if console else None
        self._bar = None
        if self._console is not None and self._console.isatty():
            self._bar = tqdm(total=train_iters, initial=resume_iteration, desc="train", unit="step",
                             file=self._console, dynamic_ncols=True)
        self._total, self._first = train_iters, resume_iteration
        self._every = max(1, (train_iters - resume_iteration) // PLAIN_PROGRESS_LINES)
        self._started = self._said = time.monotonic()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write one step everywhere and flush, so a kill loses at most the step being written."""
        if step <= self.last_step:
            raise ValueError(f"step {step} comes after step {self.last_step} was logged; log each step once, "
                             f"in increasing order.")
        self.last_step = step
        values = {key: float(value) for key, value in metrics.items()}
        if self._jsonl is not None:
            record = {"step": step, **{key: _json_value(value) for key, value in values.items()}}
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, step)
            self._writer.flush()
        for tracker in self._trackers:
            tracker.log(step, values)
        postfix = {label: f"{values[key]:.4g}" for key, label in POSTFIX.items() if key in values}
        if self._bar is not None:
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(step - self._bar.n)
        elif self._console is not None:
            self._plain_line(step, postfix)

    def _plain_line(self, step: int, postfix: Mapping[str, str]) -> None:
        now = time.monotonic()
        if step % self._every and step != self._total and now - self._said < PLAIN_PROGRESS_S:
            return
        self._said = now
        per_step = (now - self._started) / (step - self._first)
        eta = time.strftime("%H:%M:%S", time.gmtime(per_step * (self._total - step)))
        fields = " ".join(f"{label}={value}" for label, value in postfix.items())
        print(f"[mindrl] step {step}/{self._total} ({step / self._total:.0%}), {per_step:.3g} s/step, ETA {eta}"
              f"{', ' + fields if fields else ''}", file=self._console, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
        if self._jsonl is not None:
            self._jsonl.close()
        for tracker in self._trackers:
            tracker.close()

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
