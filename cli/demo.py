"""The learning demo: SFT warm start, (optionally DPO,) GRPO, and the held-out accuracy after each, on CPU.

    python cli/demo.py [--seed 1234] [--sft-steps N] [--dpo [--dpo-steps N]] [--grpo-steps N] [--out runs/facts]
                       [--png PATH] [--vision] [--lora] [--tools] [--rollout-mode MODE]

Needs the facts tokenizer and data (scripts/demo.sh makes them, and the preference pairs `--dpo` reads).
Runs cli/train_sft.py (sft_facts_cpu), evaluates its checkpoint greedily on the held-out split with
cli/evaluate.py, with `--dpo` runs cli/train_dpo.py (dpo_facts_cpu) from it and evaluates that, runs
cli/train_grpo.py (grpo_facts_cpu) from the last stage, evaluates the result the same way, writes the
reward / accuracy curve to `--png` and prints the table, the evaluation commands (run again, they print
the same figures) and one JSON line (every figure: `<out>/demo.json`). Each stage keeps what its libraries
print in its own log (`<out>/<stage>/run.log`, `<out>/evaluate.log`); the console shows mindrl's lines.
Step counts default to the configs'. `--vision` runs the same chain (without DPO) for the vision-language model on
the shape images: sft_vl_cpu, then grpo_tiny_vl_cpu (scripts/demo.sh --vision makes its tokenizer and data).
`--lora` trains GRPO with LoRA adapters instead of the whole model (LORA_GRPO: rank 16 on every linear layer,
share_backbone's reference, a learning rate 10× the full run's, as adapters need). `--tools` runs the tool-use
chain on two-digit products: sft_tools_cpu (a short SFT on trajectories that call the python tool), then
grpo_tools_cpu with multi-turn rollouts, and the same GRPO once more with tools off for comparison; the table
adds the share of held-out answers that called a tool. `--rollout-mode` runs the GRPO stage with the vLLM engine on
a core of its own in that rl_config.rollout_mode (sync, one_step_off_policy, streaming; docs/async_rollout.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: every held-out figure of both evaluations, beside the checkpoints (the console's JSON line is the summary)
FIGURES = "demo.json"


def _cli(args: list[str], capture: bool = False) -> tuple[float, str]:
    """A CLI as a child process (its console output passes through unless captured); returns its wall
    seconds and, when captured, its standard output."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], text=True, stdout=subprocess.PIPE if capture else None,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")})
    if done.returncode:
        raise SystemExit(f"demo: {Path(args[0]).name} {' '.join(args[1:3])} failed (exit {done.returncode}); "
                         f"see above.")
    return time.perf_counter() - start, done.stdout or ""


def evaluate_command(load: Path, data: str, tokenizer: str, task: str = "facts", tools: bool = False) -> list[str]:
    """cli/evaluate.py's arguments for the demo's held-out figures: greedy, the trainer's verifiers and lengths;
    `tools`: with grpo_tools_cpu's agent loop."""
    lengths = (["--max-tokens", "48", "--max-model-len", "160", "--verifiers", "gsm8k", "--weights", "1.0"]
               if task == "tools" else ["--max-tokens", "16", "--max-model-len", "96", "--verifiers", "gsm8k",
                                        "answer_sentence", "--weights", "1.0", "0.1"])
    if tools:
        lengths += ["--multi-turn", "--max-tool-calls", "2", "--max-total-response-length", "128"]
    return [os.path.relpath(ROOT / "cli" / "evaluate.py"), "--load", str(load), "--data", data,
            "--tokenizer", tokenizer, *lengths, "--log", os.path.relpath(load.parent / "evaluate.log")]


def _accuracy(command: list[str]) -> dict:
    _, out = _cli(command, capture=True)
    return json.loads(out.strip().splitlines()[-1])["by_source"]["all"]


#: each demo's curve title: the task and the model
TITLES = {"facts": "GRPO on the times table (2.5M-param Qwen2, 2 CPU cores)",
          "shapes": "GRPO on the shape images (tiny Qwen2.5-VL, 2 CPU cores)",
          "tools": "GRPO with a python tool on two-digit products (2.5M-param Qwen2, 2 CPU cores)"}
#: the tool-use demo's comparison: the same GRPO run, every multi-turn key taken out
TOOLS_OFF = ["rl_config.multi_turn_enable=false", *(f"~rl_config.{key}" for key in (
    "tool_config_path", "max_tool_calls", "max_parallel_calls", "max_total_response_length",
    "max_tool_response_length", "tool_response_truncate_side", "tool_parser_format"))]


def write_curve(metrics_file: Path, before: float, after: float, png: Path, start: str = "SFT",
                title: str = TITLES["facts"]) -> None:
    """Mean reward and training accuracy per GRPO step (and their 10-step means), the held-out greedy
    accuracy at each validation, and after the stage GRPO started from (`start`) and after GRPO as the
    dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    steps = [line["step"] for line in lines]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    curves = [("accuracy", "training accuracy", "tab:blue"), ("grpo/score/mean", "mean reward", "tab:orange")]
    if "multi_turn/tool_call_share" in lines[0]:
        curves.append(("multi_turn/tool_call_share", "answers calling a tool", "tab:green"))
    for key, label, colour in curves:
        values = [line[key] for line in lines]
        smooth = [sum(values[max(0, i - 9):i + 1]) / len(values[max(0, i - 9):i + 1]) for i in range(len(values))]
        ax.plot(steps, values, color=colour, alpha=0.25, linewidth=1)
        ax.plot(steps, smooth, color=colour, label=f"{label} (10-step mean)")
    checks = [(line["step"], line["validation/accuracy"]) for line in lines if "validation/accuracy" in line]
    if checks:
        ax.plot(*zip((0, before), *checks, strict=True), "o-", color="black", markersize=4,
                label="held-out accuracy (greedy)")
    ax.axhline(before, color="grey", linestyle="--", label=f"held-out accuracy after {start} ({before:.1%})")
    ax.axhline(after, color="black", linestyle="--", label=f"held-out accuracy after GRPO ({after:.1%})")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1.15)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


#: the GRPO stage with LoRA (--lora): adapters on every linear layer, the frozen base as the KL reference; LoRA's
#: low-rank update moves the policy less per step than the full one at the same rate, hence lr 1e-3 (full: 1e-4)
LORA_GRPO = ["+actor_config.lora_target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
             "+actor_config.lora_r=16", "+actor_config.lora_alpha=32", "+rl_config.share_backbone=true",
             "actor_config.lr=1e-3"]


#: the GRPO stage's placement and schedule per --rollout-mode: the engine on a core of its own, the actor on the other;
#: streaming within 2 versions, responses in up to 2 segments, the decoupled weight truncated (TIS)
_OWN_CORE = ["rl_config.actor_resource.num_cpus=1", "+rl_config.rollout_resource.num_cpus=1",
             "+rl_config.rollout_is=token"]
ROLLOUT_MODES = {
    "sync": [*_OWN_CORE, "+rl_config.rollout_mode=sync"],
    "one_step_off_policy": [*_OWN_CORE, "+rl_config.rollout_mode=one_step_off_policy"],
    "streaming": [*_OWN_CORE, "+rl_config.rollout_mode=streaming", "+rl_config.max_staleness=2",
                  "+rl_config.partial_rollout_max_split=2"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--sft-steps", type=int, default=None, help="default: the SFT config's train_iters")
    parser.add_argument("--grpo-steps", type=int, default=None, help="default: the GRPO config's train_iters")
    parser.add_argument("--dpo", action="store_true", help="a DPO stage between SFT and GRPO (the R1 chain)")
    parser.add_argument("--dpo-steps", type=int, default=None, help="default: dpo_facts_cpu's train_iters")
    parser.add_argument("--dpo-data", default="data/facts_dpo", help="the preference pairs (facts_dpo recipe)")
    parser.add_argument("--vision", action="store_true",
                        help="the vision-language demo: tiny_qwen25_vl on the shape images (sft_vl_cpu, "
                             "grpo_tiny_vl_cpu; default data data/shapes, tokenizer data/tiny_vl_tokenizer)")
    parser.add_argument("--lora", action="store_true", help="GRPO trains LoRA adapters (rank 16, share_backbone)")
    parser.add_argument("--tools", action="store_true",
                        help="the tool-use demo: two-digit products through the python tool (sft_tools_cpu, "
                             "grpo_tools_cpu, and grpo_tools_cpu with tools off; data data/tools, tokenizer "
                             "data/tools_tokenizer)")
    parser.add_argument("--rollout-mode", choices=sorted(ROLLOUT_MODES), default=None,
                        help="GRPO with the vLLM engine on one core and the actor on the other, in this "
                             "rl_config.rollout_mode (docs/async_rollout.md); default: colocated, synchronous")
    parser.add_argument("--out", default=None, help="where the checkpoints and metrics go (default runs/facts, "
                                                    "runs/shapes with --vision)")
    parser.add_argument("--data", default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--png", default=None, help="the curve (default: <out>/curve.png)")
    args = parser.parse_args(argv)
    if sum((args.dpo, args.vision, args.tools)) > 1:
        print("error: --dpo, --vision and --tools are separate demos; pick one.", file=sys.stderr)
        return 2
    task, sft_config, grpo_config = ("shapes", "sft_vl_cpu", "grpo_tiny_vl_cpu") if args.vision else (
        "tools", "sft_tools_cpu", "grpo_tools_cpu") if args.tools else ("facts", "sft_facts_cpu", "grpo_facts_cpu")
    args.out = args.out or f"runs/{task}"
    args.data = args.data or f"data/{task}"
    args.tokenizer = args.tokenizer or {"shapes": "data/tiny_vl_tokenizer", "tools": "data/tools_tokenizer"}.get(
        task, "data/facts_tokenizer")
    out = Path(args.out)
    common = [f"megatron_training.seed={args.seed}", f"megatron_training.data_path={args.data}",
              f"megatron_training.tokenizer_name_or_path={args.tokenizer}"]

    def steps(count: int | None) -> list[str]:
        return [] if count is None else [f"megatron_training.train_iters={count}"]

    needed = [Path(args.tokenizer) / "tokenizer.json", Path(args.data) / "train.parquet"]
    for path in needed + ([Path(args.dpo_data) / "train.parquet"] if args.dpo else []):
        if not path.is_file():
            print(f"error: {path} is missing; make the {task} tokenizer and data first (scripts/demo.sh"
                  f"{' --vision' if args.vision else ' --tools' if args.tools else ''} does).", file=sys.stderr)
            return 2
    stages = ["sft", "dpo", "grpo"] if args.dpo else ["sft", "grpo"]
    evaluations = [evaluate_command(out / stage, args.data, args.tokenizer, task, tools=args.tools)
                   for stage in stages]
    seconds, held_out = {}, {}
    seconds["sft"], _ = _cli([str(ROOT / "cli" / "train_sft.py"), "--config-name", sft_config, *common,
                              *steps(args.sft_steps), f"megatron_training.save={out / 'sft'}"])
    held_out["sft"] = _accuracy(evaluations[0])
    if args.dpo:
        dpo = [f"megatron_training.seed={args.seed}", f"megatron_training.data_path={args.dpo_data}",
               f"megatron_training.tokenizer_name_or_path={args.tokenizer}"]
        seconds["dpo"], _ = _cli([str(ROOT / "cli" / "train_dpo.py"), "--config-name", "dpo_facts_cpu", *dpo,
                                  *steps(args.dpo_steps), f"megatron_training.save={out / 'dpo'}",
                                  f"megatron_training.load={out / 'sft'}"])
        held_out["dpo"] = _accuracy(evaluations[1])
    seconds["grpo"], _ = _cli([str(ROOT / "cli" / "train_grpo.py"), "--config-name", grpo_config, *common,
                               *steps(args.grpo_steps), f"megatron_training.save={out / 'grpo'}",
                               f"actor_config.load={out / stages[-2]}",
                               f"generate_config.sampling_config.seed={args.seed}",
                               *(LORA_GRPO if args.lora else []),
                               *(ROLLOUT_MODES[args.rollout_mode] if args.rollout_mode else [])])
    held_out["grpo"] = _accuracy(evaluations[-1])
    if args.tools:  # the comparison: the same GRPO from the same SFT, answering in one turn without tools
        evaluations.append(evaluate_command(out / "grpo_tools_off", args.data, args.tokenizer, task))
        seconds["grpo_tools_off"], _ = _cli([str(ROOT / "cli" / "train_grpo.py"), "--config-name", grpo_config,
                                             *common, *steps(args.grpo_steps),
                                             f"megatron_training.save={out / 'grpo_tools_off'}",
                                             f"actor_config.load={out / 'sft'}",
                                             f"generate_config.sampling_config.seed={args.seed}", *TOOLS_OFF])
        held_out["grpo_tools_off"] = _accuracy(evaluations[-1])
        stages.append("grpo_tools_off")
    before, after = held_out[stages[0] if args.tools else stages[-2]], held_out["grpo"]
    png = Path(args.png) if args.png else out / "curve.png"
    start = "SFT" if args.tools else stages[-2].upper()
    write_curve(out / "grpo" / "metrics.jsonl", before["pass@1"], after["pass@1"], png, start, TITLES[task])
    names = {"grpo_tools_off": "GRPO, NO TOOLS"}
    print(f"\n{'held-out (greedy)':<24}" + "".join(f"{'after ' + names.get(s, s.upper()):>22}" for s in stages))
    rows = ((("pass@1", "accuracy"), ("used_tool_mean", "answers calling a tool"), ("turns_mean", "turns per answer"))
            if args.tools else (("pass@1", "accuracy"), ("score/answer_sentence_mean", "answer layout")))
    for key, label in (*rows, ("response_length_mean", "response tokens")):
        fmt = "{:>22.1%}" if key in ("pass@1", "used_tool_mean", "score/answer_sentence_mean") else "{:>22.1f}"
        print(f"{label:<24}" + "".join(fmt.format(held_out[stage][key]) for stage in stages))
    print(f"GRPO gain: {100 * (after['pass@1'] - before['pass@1']):+.1f} points in {seconds['grpo']:.0f} s "
          f"({', '.join(f'{names.get(s, s.upper())} {seconds[s]:.0f} s' for s in stages if s != 'grpo')}); "
          f"curve: {png}")
    # each command over two lines, as a shell reads them: a long path would take a line past a screen's width
    print("the held-out figures again:\n" + "\n".join(f"  python {' '.join(c[:7])} \\\n      {' '.join(c[7:])}"
                                                       for c in evaluations) + "\n")
    summary = {"seed": args.seed, "lora": args.lora, "tools": args.tools, "rollout_mode": args.rollout_mode,
               **{f"{stage}_accuracy": held_out[stage]["pass@1"] for stage in stages},
               "gain_points": round(100 * (after["pass@1"] - before["pass@1"]), 2),
               **{f"{stage}_seconds": round(seconds[stage], 1) for stage in stages}, "figures": str(out / FIGURES)}
    (out / FIGURES).write_text(json.dumps({**summary, "curve": str(png), "held_out": held_out}, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
