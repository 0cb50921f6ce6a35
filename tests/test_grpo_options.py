"""The GRPO trainer's options end to end (cli/train_grpo.py on Ray): a reference on devices of its own, responses
ending at the template's stop words on both engines, and DAPO's dynamic sampling."""

from pathlib import Path

import pytest
import torch

from tests import jobs

pytestmark = pytest.mark.job  # every test here starts a Ray job


def _run(overrides: list[str], log: Path) -> None:
    jobs.run("train_grpo.py", "grpo_tiny_cpu", overrides, log)


def test_a_reference_on_its_own_devices_starts_from_the_converted_weights(tiny_math_data, tmp_path):
    """Actor and reference on one CPU each (use_integrated_worker: false), both from a converted HF
    model: the first step's KL is zero (the reference is the actor's start, not a random model), the
    second's is not, the throughputs divide by both devices (e2e_tps_per_actor_device by the actor's one), and
    the exported actor is the converted model moved by two small updates."""
    from safetensors.torch import load_file

    from mindrl.ckpt_convert import hf_to_mcore
    from tests.hf_models import build_hf_model, save_hf_model

    tokenizer, root = tiny_math_data
    model = build_hf_model("qwen2", seed=5, vocab_size=1024, hidden_size=128, intermediate_size=352,
                           max_position_embeddings=1024, rope_theta=1e6)
    release = hf_to_mcore(save_hf_model(model, tmp_path / "hf"), tmp_path / "mg", "qwen2", 1, 1,
                          params_dtype=torch.float32, progress=False)
    save, log = tmp_path / "run", tmp_path / "log"
    _run(jobs.grpo_overrides(tokenizer, root / "math", save, **{
        "megatron_training.train_iters": 2, "megatron_training.save_interval": 0, "rl_config.test_interval": 0,
        "actor_config.load": release, "actor_config.lr": 1e-3, "rl_config.init_kl_coef": 0.5,
        "rl_config.mini_batch_size": 4,  # one optimizer step per batch: step 1 updates from the start weights
        "rl_config.use_integrated_worker": "false", "rl_config.actor_resource": "{num_cpus: 1}",
        "+rl_config.reference_resource": "{num_cpus: 1}"}), log)
    assert f"reference on its own 1 ranks, weights from {release}" in log.read_text()
    first, second = jobs.metrics(save / "metrics.jsonl")
    assert abs(first["actor/kl_loss"]) < 1e-9 < second["actor/kl_loss"]
    assert first["rollout_is/abs_log_prob_diff_mean"] < 1e-4 and "timing/reference_model" in first
    for line in (first, second):  # the throughputs count the reference's device too: 2 held, 1 the actor's
        assert line["e2e_tps"] * 2 == pytest.approx(line["e2e_tps_per_actor_device"] * 1, rel=1e-9)
    start = model.state_dict()["model.embed_tokens.weight"]
    end = load_file(save / "hf" / "model-00001-of-00001.safetensors")["model.embed_tokens.weight"]
    assert 0 < (end - start).norm() < 0.05 * start.norm()


RECORDER = """import json

OUT = {out!r}


def record(response: str, label: str) -> float:
    with open(OUT, "a") as f:
        f.write(json.dumps(response) + "\\n")
    return 0.0


record.worst_score = 0.0
"""


@pytest.mark.parametrize("backend", ["vllm", "megatron"])
def test_responses_end_at_the_templates_stop_word_not_only_the_tokenizers_eos(tiny_math_data, tmp_path, backend):
    """A base model's tokenizer (eos <|endoftext|>) with a chat template whose turn ends elsewhere: here half the
    vocabulary as stop words, so a response from the random policy ends within a few tokens at one of them, and
    the scorer reads the text up to it. Stopping only at eos, every response ran to max_tokens."""
    import json

    from mindrl.data.preprocess import PreprocessConfig, preprocess
    from mindrl.data.tokenizer import load_tokenizer

    tokenizer_dir, _ = tiny_math_data
    tokenizer = load_tokenizer(tokenizer_dir)
    tokenizer.eos_token = "<|endoftext|>"
    tokenizer.save_pretrained(str(tmp_path / "base"))
    words = [word for i in range(3, len(tokenizer), 2)
             if (word := tokenizer.decode([i])).strip() and tokenizer.encode(word, add_special_tokens=False) == [i]]
    templates = tmp_path / "templates.json"
    templates.write_text(json.dumps([{"name": "half_stops", "stop_words": words, "format_user": {"slots": [
        "<|im_start|>user\\n{{content}}<|im_end|>\\n<|im_start|>assistant\\n"]}}]))
    preprocess(PreprocessConfig(output_dir=str(tmp_path / "data"), tokenizer_name_or_path=str(tmp_path / "base"),
                                generator={"kind": "arithmetic", "num_samples": 40, "seed": 0},
                                prompt_type="half_stops", prompt_type_path=str(templates),
                                map_keys={"prompt": "question", "answer": "answer"}))
    recorder, texts = tmp_path / "recorder.py", tmp_path / "texts.jsonl"
    recorder.write_text(RECORDER.format(out=str(texts)))
    save = tmp_path / "run"
    _run(jobs.grpo_overrides(tmp_path / "base", tmp_path / "data", save, **{
        "megatron_training.train_iters": 2, "rl_config.test_interval": 0, "rl_config.use_tensorboard": False,
        "generate_config.backend": backend, "rl_config.overlong_buffer_enable": False,
        "rl_config.verifier_function": f"[acc,'{recorder}:record']", "rl_config.verifier_weight": "[1.0,0.0]"}),
        tmp_path / "log")
    lines = jobs.metrics(save / "metrics.jsonl")
    assert max(line["response_length/max"] for line in lines) < 32
    seen = [json.loads(line) for line in texts.read_text().splitlines()]
    assert len(seen) == 2 * 4 * 4
    assert all(any(text.endswith(word) for word in words) for text in seen)


def test_dapo_dynamic_sampling_drops_flat_groups_and_generates_until_the_batch_is_full(tiny_math_data, tmp_path):
    """16 new tokens with the overlong penalty past 8: most responses run to 16 and score alike, so most
    groups are flat; the driver keeps generating on fresh prompts until 4 informative groups are in."""
    tokenizer, root = tiny_math_data
    save = tmp_path / "run"
    _run(jobs.grpo_overrides(tokenizer, root / "math", save, **{
        "megatron_training.train_iters": 1, "rl_config.test_interval": 0, "rl_config.use_tensorboard": False,
        "generate_config.sampling_config.max_tokens": 16, "rl_config.rollout_max_tokens": 16,
        "rl_config.overlong_buffer": 8, "+rl_config.filter_groups_enable": True,
        "+rl_config.filter_groups_metric": "score", "+rl_config.filter_groups_max_batches": 40}), tmp_path / "log")
    (line,) = jobs.metrics(save / "metrics.jsonl")
    assert line["filter_groups/kept_groups"] == 4 and line["filter_groups/dropped_groups"] > 0
    rounds = line["filter_groups/num_gen_batches"]
    assert rounds > 1 and rounds * 4 == (line["filter_groups/kept_groups"] + line["filter_groups/dropped_groups"] +
                                         line["filter_groups/surplus_groups"])
    assert line["grpo/score/max"] > line["grpo/score/min"] and line["response_length/max"] <= 16
    # every round's responses count: tokens and rewards cover all that was generated, the batch only the kept
    assert line["rollout/response_tokens"] > 4 * 4 * line["response_length/mean"]
    assert line["rollout/response_tokens"] <= rounds * 4 * 4 * 16
    assert line["reward/mean"] != pytest.approx(line["grpo/score/mean"])
    assert "actor/entropy" in line  # logged although entropy_coeff is 0
