"""Supervised fine-tuning: the loss's gradient against HF transformers', the examples, the config,
and cli/train_sft.py end to end (resume, and GRPO starting from its checkpoint)."""

import dataclasses

import pytest
import torch
import transformers

from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.data.sft import read_sft_examples, sft_batch
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import hf_mapping as hfm
from mindrl.models import sharding
from mindrl.trainer.sft_config import load_sft_config
from mindrl.trainer.start import JOB_GRPO, JOB_SFT, start_point
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker
from tests import jobs
from tests.grads import assert_gradients_equal, reduced_grads
from tests.hf_models import mcore_to_hf_state

ROWS, SEQ = 4, 18
LAYOUTS = [(ParallelConfig(2, 1), 2), (ParallelConfig(1, 2), 1), (ParallelConfig(1, 1), 1)]  # TP=2, PP=2, DP=2


def _sft_batch(vocab: int) -> dict:
    """Prompts of 3–9 tokens, responses of different lengths, right padding."""
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab, (ROWS, SEQ), generator=gen)
    loss_mask = torch.zeros(ROWS, SEQ)
    for r, (prompt, end) in enumerate([(3, 17), (9, 12), (5, 18), (7, 9)]):
        loss_mask[r, prompt - 1:end - 1] = 1
    return {"tokens": tokens, "loss_mask": loss_mask}


def _sft_grads(rank: int, full: dict) -> list[dict]:
    arch = load_model_arch("tiny_qwen")
    batch = _sft_batch(arch.padded_vocab_size)
    out = []
    for par, micro in LAYOUTS:
        release_model_parallel()
        cfg = ActorConfig(lr=1e-3, mini_batch_size=ROWS, micro_batch_size=micro, clip_grad=1e9)
        worker = ActorWorker(arch, par, cfg, weights=full)
        metrics = worker.sft_step(batch)
        out.append({"tp": worker.tp_rank, "pp": worker.pp_rank, "dp": worker.dp_rank, "metrics": metrics,
                    "grads": reduced_grads(worker)})
    return out


def test_sft_gradients_equal_hf_transformers_at_tp2_pp2_and_dp2():
    """The oracle is HF's own causal-LM loss (labels -100 off the response) and its autograd."""
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=6)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**hfm.hf_config_from_arch(arch, "qwen2",
                                                                                            torch.float32)))
    model.load_state_dict(mcore_to_hf_state(full, arch), strict=False)  # the tied lm_head follows the embedding
    batch = _sft_batch(arch.padded_vocab_size)
    labels = torch.full_like(batch["tokens"], -100)
    labels[:, 1:] = torch.where(batch["loss_mask"][:, :-1].bool(), batch["tokens"][:, 1:], -100)
    loss = model(batch["tokens"], labels=labels).loss
    loss.backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    ranks = run_ranks(_sft_grads, 2, full)
    for index, (par, micro) in enumerate(LAYOUTS):
        runs = [r[index] for r in ranks]
        where = f"TP={par.tp} PP={par.pp} micro={micro}"
        assert_gradients_equal(runs, expected, arch, par, where)
        for run in runs:
            assert run["metrics"]["sft_loss"] == pytest.approx(loss.item(), rel=1e-6), where
    assert max(g.abs().max().item() for g in expected.values()) > 1e-3


R1_RESPONSE = "<think>{solution}</think> <answer>\\boxed{{{answer}}}</answer>"


def test_examples_teach_the_formatted_response_then_eos_and_mask_only_it(tiny_math_data):
    from mindrl.data.tokenizer import load_tokenizer

    tokenizer_path, root = tiny_math_data
    tokenizer = load_tokenizer(tokenizer_path)
    examples, too_long = read_sft_examples(root / "math" / "train.parquet", tokenizer, R1_RESPONSE, 768)
    assert too_long == 0 and len(examples) == 180
    text = tokenizer.decode(examples[0].response_ids[:-1])
    assert text.startswith("<think>") and "####" in text and text.endswith("}</answer>")
    assert examples[0].response_ids[-1] == tokenizer.eos_token_id
    batch = sft_batch(examples[:3], pad_id=0)
    for row, example in enumerate(examples[:3]):
        p, r = len(example.prompt_ids), len(example.response_ids)
        assert batch["loss_mask"][row].sum() == r
        # position t scores token t + 1: the mask starts on the prompt's last token, ends before the EOS
        assert batch["loss_mask"][row, p - 1] == 1 and (p < 2 or batch["loss_mask"][row, p - 2] == 0)
        assert batch["tokens"][row, p + r - 1] == tokenizer.eos_token_id
        assert batch["loss_mask"][row, p + r - 1:].sum() == 0
    lengths = sorted(len(e.prompt_ids) + len(e.response_ids) for e in examples)
    kept, dropped = read_sft_examples(root / "math" / "train.parquet", tokenizer, R1_RESPONSE, lengths[89])
    assert len(kept) + dropped == 180 and 0 < dropped < 180
    with pytest.raises(ConfigError, match=r"names \['steps'\].*has \['answer', 'id', 'kind', 'solution'\]"):
        read_sft_examples(root / "math" / "train.parquet", tokenizer, "{steps}", 768)


@pytest.mark.parametrize("override, message", [
    ("sft_config.response_format=plain", "names no field"),
    ("sft_config.response_format='{answer'", "is not a format string"),
    ("+sft_config.epochs=2", "epochs"),
    ("megatron_training.stage=ray_grpo", "is not what cli/train_sft.py trains; use sft; ray_grpo runs with "
                                         "cli/train_grpo.py"),
    ("megatron_training.global_batch_size=6", "multiple of 8"),
    ("megatron_training.tensor_model_parallel_size=3", "tensor_model_parallel_size=3"),
    ("sft_config.resource.num_cpus=0", "positive integer"),
])
def test_sft_config_mistakes_are_one_sentence(override, message):
    with pytest.raises(ConfigError, match=message):
        load_sft_config("sft_tiny_cpu", [override])


def _sft_overrides(tokenizer, data_path, save, **extra) -> list[str]:
    values = {"megatron_training.tokenizer_name_or_path": tokenizer, "megatron_training.data_path": data_path,
              "megatron_training.save": save, "megatron_training.global_batch_size": 8,
              "megatron_training.save_interval": 2, "sft_config.use_tensorboard": False, **extra}
    return [f"{key}={value}" for key, value in values.items()]


@pytest.mark.job
def test_train_sft_learns_resumes_exactly_and_is_where_grpo_starts(tiny_math_data, tmp_path):
    tokenizer, root = tiny_math_data
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    # the cosine schedule spans lr_decay_iters, not the run's train_iters, so the 4-step run's lr is the 6-step's
    six = {"megatron_training.train_iters": 6, "megatron_training.lr_decay_iters": 6}
    jobs.run("train_sft.py", "sft_tiny_cpu", _sft_overrides(tokenizer, root / "math", whole, **six),
             tmp_path / "whole.log")
    # the interrupted run saves megatron-core's distributed checkpoints, written in the background
    dist = {"+megatron_training.ckpt_format": "torch_dist", "+megatron_training.async_save": "true"}
    four = {**six, **dist, "megatron_training.train_iters": 4}
    jobs.run("train_sft.py", "sft_tiny_cpu", _sft_overrides(tokenizer, root / "math", cut, **four),
             tmp_path / "cut.log")
    jobs.run("train_sft.py", "sft_tiny_cpu", _sft_overrides(tokenizer, root / "math", cut, **six, **dist,
                                                           **{"megatron_training.load": cut}), tmp_path / "cut.log")
    assert f"resumed from {cut} at iteration 4 (epoch 0, example 32)" in (tmp_path / "cut.log").read_text()
    expected, got = jobs.metrics(whole / "metrics.jsonl"), jobs.metrics(cut / "metrics.jsonl")
    assert [line["step"] for line in got] == [1, 2, 3, 4, 5, 6]
    assert jobs.run_values(got) == jobs.run_values(expected)
    losses = [line["sft/loss"] for line in expected]
    assert losses[-1] < 0.9 * losses[0], losses  # from ln(1024) ≈ 6.9 at random weights: 7.05 → 5.81 measured
    assert (whole / "hf" / "config.json").is_file() and (cut / "hf" / "config.json").is_file()
    assert (cut / "iter_0000006" / "metadata.json").is_file() and not list(cut.glob(".tmp-*"))
    base = load_sft_config("sft_tiny_cpu").training
    loaded = dataclasses.replace(base, load=str(whole))
    assert start_point(loaded, JOB_SFT).resume == str(whole)  # SFT resumes its own checkpoint ...
    grpo = start_point(loaded, JOB_GRPO)  # ... which GRPO takes as its start weights, at step 0
    assert (grpo.iteration, grpo.initial_weights, grpo.resume) == (0, str(whole), None)
