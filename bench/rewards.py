"""Benchmark the weighted acc + format verifiers on 10k responses: one worker, then several.

    python bench/rewards.py [--samples 10000] [--workers 2]

Responses are built from the synthetic problems in the shapes a policy produces: right and
wrong boxed answers, answers as fractions or with thousands separators, answers in words,
missing tags. Prints one JSON line:

- plain_samples_per_s: the cheapest rule anyone could write (take the last \\boxed{}, compare
  the strings) in this process; it says how fast this machine is right now, so the other
  figures can be read as a ratio to it on a shared machine whose speed swings between runs;
- serial_samples_per_s: verifier_parallel=1 (one worker process, the time limit enforced);
- parallel_samples_per_s: verifier_parallel=--workers;
- startup_s: starting the workers and scoring a first handful, kept out of the rates above;
- symbolic_samples_per_s: one worker on --symbolic answers that only math-verify can decide
  (`\\frac{k\\sqrt{2}}{2}` against `\\frac{k}{\\sqrt{2}}`, `k\\pi` against `(k+1)\\pi`): none of
  the main mix needs it, so this is the rate when every answer does.

Both scorers must give identical rewards.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mindrl.config.reward import RewardConfig
from mindrl.data.synthetic import generate_problems
from mindrl.rewards import RewardScorer
from mindrl.rewards.answers import last_boxed, response_only

_WARM_UP = 16


def responses(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    texts, labels = [], []
    for problem in generate_problems("mixed", n, seed=seed):
        answer = int(problem["answer"])
        shape = rng.randrange(5)
        if shape == 0:
            body = f"\\boxed{{{answer}}}"
        elif shape == 1:
            body = f"\\boxed{{{answer + rng.choice([-2, -1, 1, 3])}}}"
        elif shape == 2:
            body = f"\\boxed{{\\frac{{{2 * answer}}}{{2}}}}"
        elif shape == 3:
            body = f"\\boxed{{{answer:,}}}"
        else:
            body = f"so it is {answer}"
        think = problem["solution"].split("\n####")[0]
        text = f"<think>{think}</think>\n<answer>{body}</answer>" if rng.random() < 0.7 else f"{think}. {body}"
        texts.append(text)
        labels.append(problem["answer"])
    return texts, labels


def symbolic(n: int) -> tuple[list[str], list[str]]:
    texts = [f"\\boxed{{\\frac{{{k}\\sqrt{{2}}}}{{2}}}}" if k % 2 else f"\\boxed{{{k}\\pi}}" for k in range(1, n + 1)]
    labels = [f"\\frac{{{k}}}{{\\sqrt{{2}}}}" if k % 2 else f"{k + 1}\\pi" for k in range(1, n + 1)]
    return texts, labels


def plain_rate(texts: list[str], labels: list[str], repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for text, label in zip(texts, labels, strict=True):
            _ = last_boxed(response_only(text)) == label.strip()
        best = min(best, time.perf_counter() - start)
    return len(texts) / best


def scored(config: RewardConfig, texts: list[str], labels: list[str]):
    """(result, steady samples/s, start-up seconds) for one scorer."""
    with RewardScorer(config) as scorer:
        start = time.perf_counter()
        scorer.score(texts[:_WARM_UP], labels[:_WARM_UP])
        startup_s = time.perf_counter() - start
        start = time.perf_counter()
        result = scorer.score(texts, labels)
        return result, len(texts) / (time.perf_counter() - start), startup_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--symbolic", type=int, default=200)
    args = parser.parse_args()
    texts, labels = responses(args.samples)
    common = dict(verifier_function=["acc", "format"], verifier_weight=[1.0, 0.5])

    plain = plain_rate(texts, labels)
    serial, serial_rate, startup_s = scored(RewardConfig(**common), texts, labels)
    parallel, parallel_rate, _ = scored(RewardConfig(**common, verifier_parallel=args.workers), texts, labels)
    if parallel.rewards != serial.rewards:
        raise SystemExit("parallel rewards differ from serial rewards")
    hard_texts, hard_labels = symbolic(args.symbolic)
    hard, symbolic_rate, _ = scored(RewardConfig(**common), hard_texts, hard_labels)
    if hard.scores["acc"] != [1.0 if k % 2 else -0.5 for k in range(1, args.symbolic + 1)]:
        raise SystemExit("math-verify decided a symbolic answer wrongly")
    print(json.dumps({
        "bench": "rewards", "samples": args.samples, "verifiers": "acc*1.0 + format*0.5", "cpus": os.cpu_count(),
        "plain_samples_per_s": round(plain), "serial_samples_per_s": round(serial_rate),
        "serial_vs_plain": round(serial_rate / plain, 3),
        "parallel_workers": args.workers, "parallel_samples_per_s": round(parallel_rate),
        "speedup": round(parallel_rate / serial_rate, 2), "startup_s": round(startup_s, 2),
        "symbolic_samples_per_s": round(symbolic_rate, 1),
        "acc_mean": round(serial.metrics["acc_rewards/mean"], 4),
        "format_mean": round(serial.metrics["format_rewards/mean"], 4),
        "timeouts": serial.metrics["acc/timeout_fraction"], "errors": serial.metrics["acc/error_fraction"],
    }))


if __name__ == "__main__":
    main()
