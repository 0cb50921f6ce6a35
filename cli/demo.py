"""The learning demo: SFT warm start, GRPO, and the held-out accuracy before and after, on CPU.

    python cli/demo.py [--seed 1234] [--sft-steps 150] [--grpo-steps 150] [--out runs/facts]

Needs the facts tokenizer and data (scripts/demo.sh makes them). Runs cli/train_sft.py
(sft_facts_cpu), evaluates its checkpoint greedily on the held-out split with cli/evaluate.py's
code, runs cli/train_grpo.py (grpo_facts_cpu) from it, evaluates the result the same way, writes
the reward / accuracy curve to `--png` and prints the before/after table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mindrl.config.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, config: str, overrides: list[str]) -> float:
    """A trainer CLI as a child process (its console output passes through); returns its wall seconds."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "cli" / script), "--config-name", config, *overrides],
                          cwd=ROOT, env={**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL",
                                                                                            "ERROR")})
    if done.returncode:
        raise SystemExit(f"demo: {script} --config-name {config} failed (exit {done.returncode}); see above.")
    return time.perf_counter() - start


def _accuracy(load: Path, data: str, tokenizer: str) -> dict:
    from mindrl.evaluation import EvalConfig, evaluate

    cfg = EvalConfig(load=str(load), data=data, tokenizer=tokenizer, max_tokens=16, max_model_len=96,
                     verifiers=["gsm8k", "answer_sentence"], weights=[1.0, 0.1])
    return evaluate(cfg)["by_source"]["all"]


def write_curve(metrics_file: Path, before: float, after: float, png: Path) -> None:
    """Mean reward and training accuracy per GRPO step (and their 10-step means), with the held-out
    greedy accuracy after SFT and after GRPO as the dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    steps = [line["step"] for line in lines]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for key, label, colour in (("accuracy", "training accuracy", "tab:blue"),
                               ("grpo/score/mean", "mean reward", "tab:orange")):
        values = [line[key] for line in lines]
        smooth = [sum(values[max(0, i - 9):i + 1]) / len(values[max(0, i - 9):i + 1]) for i in range(len(values))]
        ax.plot(steps, values, color=colour, alpha=0.25, linewidth=1)
        ax.plot(steps, smooth, color=colour, label=f"{label} (10-step mean)")
    ax.axhline(before, color="grey", linestyle="--", label=f"held-out accuracy after SFT ({before:.1%})")
    ax.axhline(after, color="black", linestyle="--", label=f"held-out accuracy after GRPO ({after:.1%})")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1.15)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("GRPO on single-digit facts (2.5M-param Qwen2, 2 CPU cores)")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--grpo-steps", type=int, default=150)
    parser.add_argument("--out", default="runs/facts", help="where the checkpoints and metrics go")
    parser.add_argument("--data", default="data/facts")
    parser.add_argument("--tokenizer", default="data/facts_tokenizer")
    parser.add_argument("--png", default=None, help="the curve (default: <out>/curve.png)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    common = [f"megatron_training.seed={args.seed}", f"megatron_training.data_path={args.data}",
              f"megatron_training.tokenizer_name_or_path={args.tokenizer}"]
    try:
        sft_s = _run("train_sft.py", "sft_facts_cpu", [*common, f"megatron_training.train_iters={args.sft_steps}",
                                                       f"megatron_training.save={out / 'sft'}"])
        before = _accuracy(out / "sft", args.data, args.tokenizer)
        grpo_s = _run("train_grpo.py", "grpo_facts_cpu",
                      [*common, f"megatron_training.train_iters={args.grpo_steps}",
                       f"megatron_training.save={out / 'grpo'}", f"actor_config.load={out / 'sft'}",
                       f"generate_config.sampling_config.seed={args.seed}"])
        after = _accuracy(out / "grpo", args.data, args.tokenizer)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    png = Path(args.png) if args.png else out / "curve.png"
    write_curve(out / "grpo" / "metrics.jsonl", before["pass@1"], after["pass@1"], png)
    print(f"\n{'held-out (greedy)':<20}{'after SFT':>12}{'after GRPO':>12}")
    for key, label in (("pass@1", "accuracy"), ("score/answer_sentence_mean", "answer layout"),
                       ("response_length_mean", "response tokens")):
        fmt = "{:>12.1%}" if key != "response_length_mean" else "{:>12.1f}"
        print(f"{label:<20}" + fmt.format(before[key]) + fmt.format(after[key]))
    print(f"GRPO gain: {100 * (after['pass@1'] - before['pass@1']):+.1f} points in {grpo_s:.0f} s "
          f"(SFT {sft_s:.0f} s); curve: {png}\n")
    print(json.dumps({"seed": args.seed, "sft_accuracy": before["pass@1"], "grpo_accuracy": after["pass@1"],
                      "gain_points": 100 * (after["pass@1"] - before["pass@1"]), "sft_seconds": sft_s,
                      "grpo_seconds": grpo_s, "prompts": before["prompts"], "curve": str(png)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
