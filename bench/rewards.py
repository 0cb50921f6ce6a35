"""Benchmark the weighted acc + format verifiers on 10k responses, serial vs parallel.

    python bench/rewards.py [--samples 10000] [--workers 2]

Responses are built from the synthetic problems in the shapes a policy produces: right and
wrong boxed answers, answers as fractions or with thousands separators, missing tags.
Prints one JSON line: samples/s serial (scored in-process) and with --workers processes,
and the speed-up; both runs must give identical rewards.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mindrl.config.reward import RewardConfig
from mindrl.data.synthetic import generate_problems
from mindrl.rewards import RewardScorer


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    texts, labels = responses(args.samples)
    common = dict(verifier_function=["acc", "format"], verifier_weight=[1.0, 0.5])

    start = time.perf_counter()
    serial = RewardScorer(RewardConfig(**common)).score(texts, labels)
    serial_s = time.perf_counter() - start

    with RewardScorer(RewardConfig(**common, verifier_parallel=args.workers)) as scorer:
        start = time.perf_counter()
        parallel = scorer.score(texts, labels)
        parallel_s = time.perf_counter() - start  # includes starting the worker processes
    if parallel.rewards != serial.rewards:
        raise SystemExit("parallel rewards differ from serial rewards")
    print(json.dumps({
        "bench": "rewards", "samples": args.samples, "verifiers": "acc*1.0 + format*0.5",
        "serial_samples_per_s": round(args.samples / serial_s, 1),
        "parallel_workers": args.workers, "parallel_samples_per_s": round(args.samples / parallel_s, 1),
        "speedup": round(serial_s / parallel_s, 2), "serial_s": round(serial_s, 2), "parallel_s": round(parallel_s, 2),
        "acc_mean": round(serial.metrics["acc_rewards/mean"], 4),
        "format_mean": round(serial.metrics["format_rewards/mean"], 4),
        "timeouts": serial.metrics["acc/timeout_fraction"], "errors": serial.metrics["acc/error_fraction"],
    }))


if __name__ == "__main__":
    main()
