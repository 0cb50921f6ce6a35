"""Hugging Face TRL's DPOTrainer on the same model shape, pairs and batch as bench/dpo.py.

    PYTHONPATH=.bench-trl python bench/trl_dpo.py --model tiny --dtype fp32 --data DIR --tokenizer DIR --steps 4

Run by bench/dpo.py (which installs TRL into .bench-trl/ on first use, outside the project's environment).
The policy is the same Qwen2 architecture (configs/model/<model>_qwen.yaml) with random weights and TRL's
reference a copy of them; the pairs are the texts of the same pairwise parquet (the rendered prompt, the
chosen and rejected responses, to which TRL adds the EOS as our preprocessing does), tokenized by TRL; each
optimizer step takes `--pairs` pairs in micro-batches of `--micro-pairs` (gradient accumulation), the sigmoid
loss, on the CPU with two threads. Prints one JSON line with the seconds of each step, the mean prompt and
response tokens of a pair as TRL tokenized them (both rows), and the logged losses.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), required=True)
    parser.add_argument("--data", required=True, help="cli/preprocess_data.py output folder (is_pairwise_dataset)")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--micro-pairs", type=int, default=8)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--max-length", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(2)

    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    rows = pq.read_table(Path(args.data) / "train.parquet", columns=["prompt", "chosen", "rejected"]).to_pylist()
    dataset = datasets.Dataset.from_list(rows)

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        trainer = DPOTrainer(
            model=save_policy(args.model, Path(out) / "policy"), processing_class=tokenizer, train_dataset=dataset,
            callbacks=[timer],
            args=DPOConfig(output_dir=out, use_cpu=True, bf16=args.dtype == "bf16", learning_rate=args.lr,
                           beta=args.beta, loss_type=["sigmoid"], per_device_train_batch_size=args.micro_pairs,
                           gradient_accumulation_steps=args.pairs // args.micro_pairs, max_length=args.max_length,
                           max_steps=args.steps, logging_steps=1, report_to=[], save_strategy="no", seed=1234,
                           lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                           dataloader_num_workers=0, model_init_kwargs={"dtype": torch.float32}))
        trained = trainer.train_dataset
        pair_tokens = sum(2 * len(p) + len(c) + len(r) for p, c, r in zip(
            trained["prompt_ids"], trained["chosen_ids"], trained["rejected_ids"], strict=True)) / len(trained)
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(json.dumps({"step_s": timer.steps, "pair_tokens": pair_tokens, "loss": losses}))


if __name__ == "__main__":
    main()
