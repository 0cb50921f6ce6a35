"""cli/demo.py shortened: facts tokenizer and data, SFT, greedy evaluation, GRPO from the SFT
checkpoint, evaluation again, the curve PNG and the summary line — the whole chain, a few steps."""

import json
import subprocess
import sys

from mindrl.data.preprocess import PreprocessConfig, preprocess
from tests import jobs


def test_the_demo_chain_runs_sft_then_grpo_from_it_and_reports_before_and_after(tmp_path):
    cli = jobs.ROOT / "cli"
    tokenizer = tmp_path / "tok"
    subprocess.run([sys.executable, str(cli / "build_tiny_tokenizer.py"), "--out", str(tokenizer), "--task", "facts",
                    "--vocab-size", "512", "--split-digits"], check=True, capture_output=True)
    preprocess(PreprocessConfig(output_dir=str(tmp_path / "facts"), tokenizer_name_or_path=str(tokenizer),
                                generator={"kind": "facts", "num_samples": 400, "seed": 0}, prompt_type="chatml",
                                map_keys={"prompt": "question", "answer": "answer"}, data_source="facts",
                                max_prompt_length=64, test_fraction=0.1))
    out, log = tmp_path / "run", tmp_path / "demo.log"
    with open(log, "w") as sink:
        done = subprocess.run([sys.executable, str(cli / "demo.py"), "--sft-steps", "4", "--grpo-steps", "2",
                               "--out", str(out), "--data", str(tmp_path / "facts"), "--tokenizer", str(tokenizer)],
                              stdout=sink, stderr=subprocess.STDOUT, cwd=jobs.ROOT, timeout=jobs.JOB_LIMIT_S)
    text = log.read_text()
    assert done.returncode == 0, text[-6000:]
    summary = json.loads(text.strip().splitlines()[-1])
    assert summary["prompts"] == 40 and 0 <= summary["sft_accuracy"] <= 1 and 0 <= summary["grpo_accuracy"] <= 1
    assert "held-out (greedy)" in text and "GRPO gain:" in text
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sft, grpo = jobs.metrics(out / "sft" / "metrics.jsonl"), jobs.metrics(out / "grpo" / "metrics.jsonl")
    assert len(sft) == 4 and len(grpo) == 2
    # GRPO starts from the SFT weights, which are also its KL reference: no divergence before the first update
    assert grpo[0]["actor/kl_loss"] == 0.0 < grpo[1]["actor/kl_loss"]
