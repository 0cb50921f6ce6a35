"""cli/demo.py shortened: facts tokenizer and data, SFT, greedy evaluation, GRPO from the SFT
checkpoint, evaluation again, the curve PNG and the summary line — the whole chain, a few steps —
and cli/evaluate.py, run again by the commands the demo prints, giving the demo's own figures."""

import json
import subprocess
import sys

import pytest

from mindrl.data.preprocess import PreprocessConfig, preprocess
from tests import jobs

pytestmark = pytest.mark.job  # every test here starts a Ray job or a vLLM engine


def test_the_demo_chain_runs_each_stage_from_the_last_and_its_figures_reproduce(tmp_path):
    # the main job's chain; the --dpo chain (6 min more here) adds a cli/train_dpo.py stage, which
    # tests/test_dpo.py runs (resumed after SIGKILL, and as the checkpoint GRPO starts from)
    stages = ("sft", "grpo")
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
    logs = "".join((out / stage / "run.log").read_text() for stage in stages)
    assert "Triton not available" in logs and "NUMA binding" in logs and "FutureWarning" in logs
    summary = json.loads(text.strip().splitlines()[-1])
    figures = json.loads((out / "demo.json").read_text())
    assert {k: figures[k] for k in summary} == summary
    held_out = figures["held_out"]
    assert list(held_out) == list(stages) and {held_out[stage]["prompts"] for stage in stages} == {40}
    assert all(held_out[stage]["pass@1"] == summary[f"{stage}_accuracy"] for stage in stages)
    assert "held-out (greedy)" in text and "GRPO gain:" in text
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = {stage: jobs.metrics(out / stage / "metrics.jsonl") for stage in stages}
    steps = {"sft": 4, "grpo": 2}
    assert {stage: len(lines[stage]) for stage in stages} == {stage: steps[stage] for stage in stages}
    # GRPO starts from SFT's weights, which are also its reference: no divergence before the first update
    assert lines["grpo"][0]["actor/kl_loss"] == 0.0 < lines["grpo"][1]["actor/kl_loss"]

    commands = [line.split()[1:] for line in text.replace(" \\\n", " ").splitlines() if line.startswith("  python ")]
    assert [c[c.index("--load") + 1] for c in commands] == [str(out / stage) for stage in stages]
    for command, stage in zip(commands, stages, strict=True):
        assert command[0] == "cli/evaluate.py"
        assert jobs.evaluate(*command[1:])["by_source"]["all"] == held_out[stage]
