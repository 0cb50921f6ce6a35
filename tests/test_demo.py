"""cli/demo.py shortened: facts tokenizer and data, SFT, greedy evaluation, GRPO from the SFT
checkpoint, evaluation again, the curve PNG and the summary line — the whole chain, a few steps —
and cli/evaluate.py, run again by the commands the demo prints, giving the demo's own figures."""

import json
import os
import subprocess
import sys

from mindrl.data.preprocess import PreprocessConfig, preprocess
from tests import jobs


def test_the_demo_chain_runs_sft_then_grpo_from_it_and_its_figures_reproduce(tmp_path):
    cli = jobs.ROOT / "cli"
    tokenizer = tmp_path / "tok"
    subprocess.run([sys.executable, str(cli / "build_tiny_tokenizer.py"), "--out", str(tokenizer), "--task", "facts",
                    "--vocab-size", "512", "--split-digits"], check=True, capture_output=True)
    preprocess(PreprocessConfig(output_dir=str(tmp_path / "facts"), tokenizer_name_or_path=str(tokenizer),
                                generator={"kind": "facts", "num_samples": 400, "seed": 0}, prompt_type="chatml",
                                map_keys={"prompt": "question", "answer": "answer"}, data_source="facts",
                                max_prompt_length=64, test_fraction=0.1, unseen_test_prompts=True))
    out, log = tmp_path / "run", tmp_path / "demo.log"
    with open(log, "w") as sink:
        done = subprocess.run([sys.executable, str(cli / "demo.py"), "--sft-steps", "4", "--grpo-steps", "2",
                               "--out", str(out), "--data", str(tmp_path / "facts"), "--tokenizer", str(tokenizer)],
                              stdout=sink, stderr=subprocess.STDOUT, cwd=jobs.ROOT, timeout=jobs.JOB_LIMIT_S)
    text = log.read_text()
    assert done.returncode == 0, text[-6000:]
    # a quiet console: other libraries' notices are in each stage's log, none on the console, no line a screen long
    for noise in ("FutureWarning", "Triton not available", "NUMA binding", "RAY_DEDUP_LOGS"):
        assert noise not in text, noise
    assert max(map(len, text.splitlines())) <= 300
    logs = "".join((out / stage / "run.log").read_text() for stage in ("sft", "grpo"))
    assert "Triton not available" in logs and "NUMA binding" in logs and "FutureWarning" in logs
    summary = json.loads(text.strip().splitlines()[-1])
    figures = json.loads((out / "demo.json").read_text())
    assert {k: figures[k] for k in summary} == summary
    held_out = figures["held_out"]
    assert held_out["sft"]["prompts"] == held_out["grpo"]["prompts"] == 40
    assert held_out["sft"]["pass@1"] == summary["sft_accuracy"]
    assert held_out["grpo"]["pass@1"] == summary["grpo_accuracy"]
    assert "held-out (greedy)" in text and "GRPO gain:" in text
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sft, grpo = jobs.metrics(out / "sft" / "metrics.jsonl"), jobs.metrics(out / "grpo" / "metrics.jsonl")
    assert len(sft) == 4 and len(grpo) == 2
    # GRPO starts from the SFT weights, which are also its KL reference: no divergence before the first update
    assert grpo[0]["actor/kl_loss"] == 0.0 < grpo[1]["actor/kl_loss"]

    commands = [line.split()[1:] for line in text.replace(" \\\n", " ").splitlines() if line.startswith("  python ")]
    assert [c[c.index("--load") + 1] for c in commands] == [str(out / "sft"), str(out / "grpo")]
    for command, stage in zip(commands, ("sft", "grpo"), strict=True):
        again = subprocess.run([sys.executable, *command], cwd=jobs.ROOT, capture_output=True, text=True,
                               timeout=jobs.JOB_LIMIT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert again.returncode == 0, again.stderr[-4000:]
        assert json.loads(again.stdout.strip().splitlines()[-1])["by_source"]["all"] == held_out[stage]
