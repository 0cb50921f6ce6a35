"""DPO steps of cli/train_dpo.py against the machine's own matmul rate and against TRL's DPOTrainer.

    python bench/dpo.py [--steps 4] [--models tiny,small] [--dtypes fp32,bf16] [--response-tokens 128] [--no-trl]

Synthetic preference pairs: a templated math question (about 60 tokens) and, as chosen and rejected,
different worked solutions of about `--response-tokens` tokens each (EOS included). The model is
configs/model/<model>_qwen.yaml with random weights, its frozen reference the same weights; 16 pairs per
optimizer step in micro-batches of 8 pairs, the sigmoid loss with β 0.1, lr 1e-6, two CPU ranks (DP=2).
Reported per configuration: tokens/s (the prompt and response tokens of both rows of every pair over the
step's seconds, whole machine) and achieved GFLOP/s — the matmul FLOPs of the reference's forward and the
policy's forward and backward, four forwards in all (where a pair's two rows were packed behind one copy of
their prompt, `actor/prompt_packed`, that prompt counts once) — beside a plain matmul's GFLOP/s in the same
precision on the same two cores, measured right before and right after (the higher counts). Each
configuration runs the real trainer in a fresh process; its first step is left out of the means.
Beside each, Hugging Face TRL's DPOTrainer on the same texts, model shape, batch, micro-batches, loss and
lr, in one process with two threads (bench/trl_dpo.py; TRL is installed into .bench-trl/ as
bench/grpo_e2e.py does), and the ratio of the two token rates. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from grpo_e2e import _pass_flops, run_trl  # noqa: E402  (the GRPO benchmark's FLOP model and TRL runner)
from rollout import _matmul  # noqa: E402

from mindrl.config import load_model_arch  # noqa: E402
from mindrl.data.preprocess import PreprocessConfig, preprocess  # noqa: E402
from mindrl.data.synthetic import generate_problems  # noqa: E402
from mindrl.launch import run_ranks  # noqa: E402

PAIRS, MICRO_PAIRS, BETA, LR = 16, 8, 0.1, 1e-6


def _solutions(problems: list[dict], rng: random.Random, tokens: int, tokenizer) -> str:
    """Worked solutions joined until the text reaches `tokens` tokens (its EOS included)."""
    text = ""
    while len(tokenizer.encode(text, add_special_tokens=False)) + 1 < tokens:
        text += ("" if not text else " ") + rng.choice(problems)["solution"].replace("\n", " ")
    return text


def _data(folder: Path, response_tokens: int, pairs: int) -> tuple[Path, Path]:
    """The tiny tokenizer and a pairwise parquet of `pairs` rows."""
    from mindrl.data.tokenizer import load_tokenizer

    tokenizer_dir, data = folder / "tokenizer", folder / "pairs"
    subprocess.run([sys.executable, str(ROOT / "cli" / "build_tiny_tokenizer.py"), "--out", str(tokenizer_dir)],
                   check=True, capture_output=True)
    tokenizer = load_tokenizer(str(tokenizer_dir))
    problems, rng = generate_problems("mixed", 4 * pairs, seed=0), random.Random(0)
    rows = [{"question": p["question"], "chosen": _solutions(problems, rng, response_tokens, tokenizer),
             "rejected": _solutions(problems, rng, response_tokens, tokenizer)} for p in problems[:pairs]]
    raw = folder / "pairs.jsonl"
    raw.write_text("".join(json.dumps(row) + "\n" for row in rows))
    preprocess(PreprocessConfig(output_dir=str(data), tokenizer_name_or_path=str(tokenizer_dir), input=str(raw),
                                is_pairwise_dataset=True, map_keys={"prompt": "question", "chosen": "chosen",
                                                                    "rejected": "rejected"}, data_source="bench"))
    return tokenizer_dir, data


def _train(model: str, dtype: str, steps: int, tokenizer: Path, data: Path, seq_length: int, out: Path) -> list[dict]:
    overrides = {"model": f"[{model}_qwen]", "megatron_training.model": f"{model}_qwen",
                 "megatron_training.load": "null", "megatron_training.tokenizer_name_or_path": tokenizer,
                 "megatron_training.data_path": data, "megatron_training.save": out,
                 "megatron_training.seq_length": seq_length, "megatron_training.train_iters": steps,
                 "megatron_training.global_batch_size": PAIRS, "megatron_training.micro_batch_size": MICRO_PAIRS,
                 "megatron_training.bf16": dtype == "bf16", "megatron_training.lr": LR,
                 "dpo_config.dpo_beta": BETA, "dpo_config.rpo_alpha": 0.0, "dpo_config.test_interval": 0}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "cli" / "train_dpo.py"), "--config-name", "dpo_facts_cpu",
                          *(f"{key}={value}" for key, value in overrides.items())], env=env, capture_output=True,
                         text=True)
    if run.returncode:
        raise RuntimeError(f"DPO {model} {dtype} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _shape(data: Path) -> tuple[float, float, int]:
    """Mean prompt and response tokens of the pairs, and the longest prompt and response (the runs' seq_length)."""
    import pyarrow.parquet as pq

    table = pq.read_table(data / "train.parquet", columns=["prompt_ids", "chosen_ids", "rejected_ids"]).to_pydict()
    longest = max(len(p) + max(len(c), len(r)) for p, c, r in zip(*table.values(), strict=True))
    mean = {key: sum(map(len, values)) / len(values) for key, values in table.items()}
    return mean["prompt_ids"], (mean["chosen_ids"] + mean["rejected_ids"]) / 2, longest


def _summary(model: str, lines: list[dict], prompt: float, response: float) -> dict:
    arch = load_model_arch(f"{model}_qwen")
    timed = lines[1:] or lines
    seconds = sum(line["timing/all"] for line in timed) / len(timed)
    packed = sum(line["actor/prompt_packed"] for line in timed) / len(timed)
    flops = 4 * _pass_flops(arch, PAIRS, 2, round(prompt), round(response), packed)
    return {"tokens_per_s": round(PAIRS * 2 * (prompt + response) / seconds, 1), "step_s": round(seconds, 3),
            "gflops": round(flops / seconds / 1e9, 1), "prompt_packed": packed}


def _trl(model: str, dtype: str, steps: int, tokenizer: Path, data: Path, seq_length: int) -> dict:
    """TRL's tokens/s on the same work, from its second step."""
    out = run_trl("trl_dpo.py", ["--model", model, "--dtype", dtype, "--data", str(data), "--tokenizer",
                                 str(tokenizer), "--steps", str(steps), "--pairs", str(PAIRS), "--micro-pairs",
                                 str(MICRO_PAIRS), "--beta", str(BETA), "--lr", str(LR), "--max-length",
                                 str(seq_length)], f"{model} {dtype}")
    timed = out["step_s"][1:] or out["step_s"]
    seconds = sum(timed) / len(timed)
    return {"tokens_per_s": round(PAIRS * out["pair_tokens"] / seconds, 1), "step_s": round(seconds, 3),
            "pair_tokens": round(out["pair_tokens"], 1), "loss_first": out["loss"][0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--response-tokens", type=int, default=128)
    parser.add_argument("--no-trl", action="store_true", help="leave out TRL's side")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mindrl-bench-") as tmp:
        tokenizer, data = _data(Path(tmp), args.response_tokens, PAIRS * args.steps)
        prompt, response, seq_length = _shape(data)
        result: dict = {"bench": "dpo", "pairs": PAIRS, "micro_pairs": MICRO_PAIRS, "threads": 2,
                        "prompt_len": round(prompt, 1), "response_len": round(response, 1)}
        for model in args.models.split(","):
            for dtype in args.dtypes.split(","):
                before = run_ranks(_matmul, 1, dtype, 2)[0]
                lines = _train(model, dtype, args.steps, tokenizer, data, seq_length, Path(tmp) / f"{model}_{dtype}")
                matmul = max(before, run_ranks(_matmul, 1, dtype, 2)[0])
                measured = _summary(model, lines, prompt, response)
                measured.update(matmul_gflops=round(matmul, 1), share_of_matmul=round(measured["gflops"] / matmul, 2),
                                loss_first=lines[0]["dpo/loss"])
                if not args.no_trl:
                    trl = _trl(model, dtype, args.steps, tokenizer, data, seq_length)
                    measured.update(trl=trl, vs_trl=round(measured["tokens_per_s"] / trl["tokens_per_s"], 2))
                result[f"{model}_{dtype}"] = measured
    print(json.dumps(result))


if __name__ == "__main__":
    main()
