"""Hugging Face TRL's GRPOTrainer on the same model shape, prompts and batch as bench/grpo_e2e.py.

    PYTHONPATH=.bench-trl python bench/trl_grpo.py --model tiny --dtype fp32 --data DIR --steps 3

Run by bench/grpo_e2e.py (which installs TRL into .bench-trl/ on first use, outside the project's
environment). The policy is the same Qwen2 architecture (configs/model/<model>_qwen.yaml) with
random weights, the prompts are the same templated, tokenized synthetic-math prompts, the reward
is the same weighted acc + format verifiers, with 16 prompts × 8 samples, one optimizer step per
batch, lr 1e-5 and β = 0.04 against a reference model, on the CPU with two threads. Prints one
JSON line with the seconds of each step and the mean prompt and completion lengths.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from trl_side import StepTimer, save_policy  # noqa: E402

from mindrl.rewards.verifiers import accuracy, loose_format  # noqa: E402

NEW_TOKENS = {"tiny": 64, "small": 128}


def _reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
    return [accuracy(c, a) + 0.1 * loose_format(c, a) for c, a in zip(completions, answer, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(NEW_TOKENS), required=True)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), required=True)
    parser.add_argument("--data", required=True, help="cli/preprocess_data.py output folder")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)

    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    tokenizer.padding_side = "left"
    rows = pq.read_table(Path(args.data) / "train.parquet").to_pylist()
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(
            model=save_policy(args.model, Path(out) / "policy"), reward_funcs=[_reward], processing_class=tokenizer,
            train_dataset=dataset, callbacks=[timer],
            args=GRPOConfig(output_dir=out, use_cpu=True, bf16=args.dtype == "bf16", learning_rate=1e-5, beta=0.04,
                            num_generations=8, per_device_train_batch_size=128, gradient_accumulation_steps=1,
                            max_completion_length=NEW_TOKENS[args.model], max_steps=args.steps, logging_steps=1,
                            temperature=1.0, report_to=[], save_strategy="no", seed=1234,
                            dataloader_num_workers=0, model_init_kwargs={"dtype": torch.float32}))
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    prompt = sum(len(tokenizer(r["prompt"])["input_ids"]) for r in rows[:64]) / 64
    print(json.dumps({"step_s": timer.steps, "completion_len": [entry["completions/mean_length"] for entry in logs],
                      "prompt_len": prompt}))


if __name__ == "__main__":
    main()
