"""DPO: preference rows into pairs, the actor's DPO gradient against HF transformers' with TRL's loss written
out, the config, and cli/train_dpo.py end to end (exact resume, and GRPO starting from its checkpoint)."""

import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F
import transformers

from mindrl.algorithms.dpo_loss import DPOLossConfig
from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.data.preference import PairExample, dpo_batch, read_pairs
from mindrl.data.preprocess import PreprocessConfig, preprocess
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import hf_mapping as hfm
from mindrl.models import sharding
from mindrl.trainer.dpo_config import load_dpo_config
from mindrl.trainer.start import JOB_DPO, JOB_GRPO, start_point
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker
from tests import jobs
from tests.grads import assert_gradients_equal, reduced_grads
from tests.hf_models import mcore_to_hf_state

# (layout, micro-batch in rows, prompt packing): TP=2, PP=2 and DP=2 on two ranks
LAYOUTS = [(ParallelConfig(2, 1), 4, "on"), (ParallelConfig(1, 2), 2, "off"), (ParallelConfig(1, 1), 2, "on")]
LOSSES = [DPOLossConfig("sigmoid", dpo_beta=0.5, dpo_label_smoothing=0.1), DPOLossConfig("ipo", dpo_beta=0.5),
          DPOLossConfig("hinge", dpo_beta=0.5), DPOLossConfig("sigmoid", dpo_beta=0.5, rpo_alpha=0.7)]


def _pairs(vocab: int) -> list[PairExample]:
    gen = torch.Generator().manual_seed(12)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    return [PairExample(ids(p), ids(c), ids(r)) for p, c, r in [(3, 6, 4), (7, 2, 5), (5, 5, 5), (4, 8, 1)]]


def _batch(vocab: int) -> dict:
    batch = dpo_batch(_pairs(vocab), pad_id=0)
    gen = torch.Generator().manual_seed(13)
    batch["ref_log_probs"] = -6.5 + torch.randn(batch["tokens"].shape, generator=gen)
    return batch


def _dpo_grads(rank: int, full: dict, loss: DPOLossConfig) -> list[dict]:
    arch = load_model_arch("tiny_qwen")
    batch = _batch(arch.padded_vocab_size)
    out = []
    for par, micro, packing in LAYOUTS:
        release_model_parallel()
        cfg = ActorConfig(lr=1e-3, mini_batch_size=8, micro_batch_size=micro, clip_grad=1e9, prompt_packing=packing)
        worker = ActorWorker(arch, par, cfg, weights=full)
        metrics = worker.dpo_step(batch, loss)
        out.append({"tp": worker.tp_rank, "pp": worker.pp_rank, "dp": worker.dp_rank, "metrics": metrics,
                    "grads": reduced_grads(worker), "packed": worker.packed})
    return out


@pytest.mark.parametrize("loss", LOSSES, ids=lambda loss: loss.dpo_loss_type + "+rpo" * bool(loss.rpo_alpha))
def test_dpo_gradients_equal_hf_transformers_with_trls_loss_at_tp2_pp2_and_dp2(loss):
    """The oracle: HF's forward and autograd, sequence log-probs summed (IPO: averaged) over the response tokens,
    and TRL's loss formula written out here, over pairs of rows in one batch (with rpo_alpha, TRL's loss_type
    ["sigmoid", "sft"] weighted [1, rpo_alpha]: the chosen tokens' mean NLL, the batch taken at once)."""
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=6)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**hfm.hf_config_from_arch(arch, "qwen2",
                                                                                            torch.float32)))
    model.load_state_dict(mcore_to_hf_state(full, arch), strict=False)  # the tied lm_head follows the embedding
    batch = _batch(arch.padded_vocab_size)
    tokens, mask = batch["tokens"], batch["loss_mask"][:, :-1]
    token_logps = torch.log_softmax(model(tokens).logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    policy, reference = (token_logps * mask).sum(-1), (batch["ref_log_probs"][:, :-1] * mask).sum(-1)
    if loss.dpo_loss_type == "ipo":
        policy, reference = policy / mask.sum(-1), reference / mask.sum(-1)
    logits = (policy[0::2] - reference[0::2]) - (policy[1::2] - reference[1::2])
    beta, eps = loss.dpo_beta, loss.dpo_label_smoothing
    if loss.dpo_loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
    elif loss.dpo_loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:
        losses = (logits - 1 / (2 * beta)) ** 2
    nll = -(token_logps[0::2] * mask[0::2]).sum() / mask[0::2].sum()
    (losses.mean() + loss.rpo_alpha * nll).backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    ranks = run_ranks(_dpo_grads, 2, full, loss)
    chosen_rewards = beta * (policy[0::2] - reference[0::2]).detach()
    rejected_rewards = beta * (policy[1::2] - reference[1::2]).detach()
    for index, (par, micro, packing) in enumerate(LAYOUTS):
        runs = [r[index] for r in ranks]
        where = f"TP={par.tp} PP={par.pp} micro={micro} packing={packing}"
        assert_gradients_equal(runs, expected, arch, par, where)
        for run in runs:
            metrics = run["metrics"]
            assert metrics["dpo_loss"] == pytest.approx(losses.mean().item(), rel=1e-5), where
            assert metrics["rewards/chosen"] == pytest.approx(chosen_rewards.mean().item(), rel=1e-4, abs=1e-6)
            assert metrics["rewards/margins"] == pytest.approx((chosen_rewards - rejected_rewards).mean().item(),
                                                               rel=1e-4, abs=1e-6)
            assert metrics["rewards/accuracies"] == (chosen_rewards > rejected_rewards).float().mean().item()
            assert metrics["logps/rejected"] == pytest.approx(policy[1::2].mean().item(), rel=1e-5)
            assert metrics.get("nll_loss", 0.0) == pytest.approx(nll.item() if loss.rpo_alpha else 0.0, rel=1e-5)
    assert any(r[0]["packed"] for r in ranks)  # the packed path (a pair behind one copy of its prompt) ran too
    assert max(g.abs().max().item() for g in expected.values()) > 1e-4


def _odd_micro(rank: int) -> str:
    arch = load_model_arch("tiny_qwen")
    worker = ActorWorker(arch, ParallelConfig(1, 1), ActorConfig(mini_batch_size=8, micro_batch_size=1))
    try:
        worker.dpo_step(_batch(arch.padded_vocab_size), DPOLossConfig())
    except ConfigError as err:
        return str(err)
    return ""


def test_a_batch_that_would_split_a_pair_is_one_sentence():
    message = run_ranks(_odd_micro, 1)[0]
    assert message.startswith("a DPO batch of 8 rows in micro-batches of 1 over 1 data-parallel ranks splits a "
                              "chosen/rejected pair")


def test_rows_are_pairs_and_only_responses_are_in_the_loss():
    pairs = [PairExample([5, 6, 7], [8, 9, 2], [10, 2]), PairExample([3], [4, 2], [11, 12, 13, 2])]
    batch = dpo_batch(pairs, pad_id=0)
    assert batch["tokens"].tolist() == [[5, 6, 7, 8, 9, 2], [5, 6, 7, 10, 2, 0], [3, 4, 2, 0, 0, 0],
                                        [3, 11, 12, 13, 2, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0],
                                           [1, 1, 1, 1, 0, 0]]
    assert batch["prompt_lengths"].tolist() == [3, 3, 1, 1] and batch["response_lengths"].tolist() == [3, 2, 2, 4]


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_preference_rows_in_the_layouts_hf_datasets_use(facts_pairs, tmp_path):
    tokenizer, _ = facts_pairs
    chat = [{"role": "user", "content": "What is 2 times 3?"}]
    rows = [{"prompt": "What is 2 times 3?", "chosen": "The answer is 6.", "rejected": "The answer is 5."},
            {"prompt": chat, "chosen": [{"role": "assistant", "content": "The answer is 6."}],
             "rejected": [{"role": "assistant", "content": "The answer is 5."}]},
            {"chosen": [*chat, {"role": "assistant", "content": "The answer is 6."}],
             "rejected": [*chat, {"role": "assistant", "content": "The answer is 5."}]}]
    preprocess(PreprocessConfig(output_dir=str(tmp_path / "out"), tokenizer_name_or_path=str(tokenizer),
                                input=_write_jsonl(tmp_path / "rows.jsonl", rows), prompt_type="chatml",
                                is_pairwise_dataset=True))
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert len({(r["prompt"], r["chosen"], r["rejected"]) for r in table}) == 1  # three layouts, one pair
    assert table[0]["prompt"] == "<|im_start|>user\nWhat is 2 times 3?<|im_end|>\n<|im_start|>assistant\n"
    eos = _eos(tokenizer)
    assert table[0]["chosen_ids"][-1] == eos and table[0]["rejected_ids"][-1] == eos
    # a pair is kept whole or dropped whole: its prompt and longer response must fit seq_length
    fits = len(table[0]["prompt_ids"]) + max(len(table[0]["chosen_ids"]), len(table[0]["rejected_ids"]))
    assert read_pairs(tmp_path / "out" / "train.parquet", seq_length=fits)[1] == 0
    with pytest.raises(ConfigError, match=f"every pair of .* is longer than seq_length={fits - 1} tokens"):
        read_pairs(tmp_path / "out" / "train.parquet", seq_length=fits - 1)
    bad = [{"chosen": [*chat, {"role": "assistant", "content": "6"}],
            "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "5"}]}]
    with pytest.raises(ConfigError, match=r"row 0 has no prompt column and its chosen and rejected conversations do "
                                          r"not share the messages before the answer; map `prompt`.*skip_bad_rows"):
        preprocess(PreprocessConfig(output_dir=str(tmp_path / "bad"), tokenizer_name_or_path=str(tokenizer),
                                    input=_write_jsonl(tmp_path / "bad.jsonl", bad), is_pairwise_dataset=True))


@pytest.mark.parametrize("row, message", [
    ({"prompt": "2 * 3 = ?", "rejected": "5"}, "rows.jsonl row 1 has no 'chosen' (mapped to chosen)"),
    ({"prompt": "2 * 3 = ?", "chosen": "6", "rejected": " "},
     "rows.jsonl row 1: 'rejected' (mapped to rejected) is an empty response"),
    ({"prompt": "2 * 3 = ?", "chosen": "6", "rejected": "6"},
     "rows.jsonl row 1: 'chosen' and 'rejected' (chosen and rejected) are the same response"),
    ({"prompt": "2 * 3 = ?", "chosen": "6", "rejected": [{"role": "user", "content": "5"}]},
     "rows.jsonl row 1: 'rejected' (mapped to rejected) ends with a 'user' message"),
])
def test_bad_preference_rows_are_one_sentence_naming_file_row_and_field_and_nothing_is_written(facts_pairs, tmp_path,
                                                                                              row, message):
    tokenizer, _ = facts_pairs
    good = {"prompt": "2 * 2 = ?", "chosen": "4", "rejected": "5"}
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}.*skip_bad_rows"):
        preprocess(PreprocessConfig(output_dir=str(tmp_path / "out"), tokenizer_name_or_path=str(tokenizer),
                                    input=_write_jsonl(tmp_path / "rows.jsonl", [good, row]),
                                    is_pairwise_dataset=True))
    assert not (tmp_path / "out").exists()


def test_a_prompt_that_leaves_no_room_for_a_response_is_one_sentence(facts_pairs):
    _, data = facts_pairs
    with pytest.raises(ConfigError, match=r"train.parquet row 0: its prompt of \d+ tokens leaves no room for a "
                                          r"response within seq_length=8"):
        read_pairs(data / "train.parquet", seq_length=8)


def _eos(path) -> int:
    from mindrl.data.tokenizer import load_tokenizer

    return load_tokenizer(path).eos_token_id


def test_the_facts_pairs_hold_out_what_the_facts_prompts_hold_out(facts_pairs, tmp_path):
    """The demo's DPO stage trains on no prompt the demo's evaluation holds out (the two recipes' splits agree)."""
    import pyarrow.parquet as pq
    import yaml

    tokenizer, _ = facts_pairs
    prompts = {}
    for recipe in ("facts", "facts_dpo"):
        values = yaml.safe_load((jobs.ROOT / "configs" / "datasets" / f"{recipe}.yaml").read_text())
        values.update(output_dir=str(tmp_path / recipe), tokenizer_name_or_path=str(tokenizer))
        preprocess(PreprocessConfig.from_dict(values))
        prompts[recipe] = {split: set(pq.read_table(tmp_path / recipe / f"{split}.parquet").column("prompt")
                                      .to_pylist()) for split in ("train", "test")}
    assert prompts["facts_dpo"]["test"] == prompts["facts"]["test"]
    assert not prompts["facts_dpo"]["train"] & prompts["facts"]["test"] and len(prompts["facts_dpo"]["train"]) > 100


@pytest.mark.parametrize("override, message", [
    ("dpo_config.dpo_beta=0", "dpo_config: dpo_beta must be positive"),
    ("dpo_config.dpo_loss_type=kto", "unknown DPO loss 'kto'"),
    ("dpo_config.dpo_label_smoothing=0.6", r"dpo_label_smoothing must be in \[0, 0.5\)"),
    ("dpo_config.rpo_alpha=-1", "dpo_config: rpo_alpha must be a finite weight ≥ 0"),
    ("+dpo_config.response_format=x", "response_format"),
    ("megatron_training.stage=sft", "is not what cli/train_dpo.py trains; use dpo; sft runs with cli/train_sft.py"),
    ("megatron_training.global_batch_size=12", "multiple of 16"),
])
def test_dpo_config_mistakes_are_one_sentence(override, message):
    with pytest.raises(ConfigError, match=message):
        load_dpo_config("dpo_facts_cpu", [override])


def test_a_reference_that_is_no_checkpoint_is_one_sentence_before_anything_starts(tmp_path):
    from mindrl.trainer.dpo import DPOTrainer

    cfg = load_dpo_config("dpo_facts_cpu", [f"dpo_config.ref_model={tmp_path}"])
    with pytest.raises(ConfigError, match=f"^dpo_config.ref_model={tmp_path} holds no latest_checkpointed_iteration"):
        DPOTrainer(cfg)


def _dpo_overrides(tokenizer, data, save, **extra) -> list[str]:
    values = {"megatron_training.tokenizer_name_or_path": tokenizer, "megatron_training.data_path": data,
              "megatron_training.save": save, "megatron_training.load": "null", "megatron_training.bf16": "false",
              "megatron_training.global_batch_size": 8, "megatron_training.micro_batch_size": 4,
              "megatron_training.save_interval": 2, "megatron_training.lr": 5e-4, "dpo_config.dpo_beta": 0.1,
              "dpo_config.rpo_alpha": 0.0, **extra}
    return [f"{key}={value}" for key, value in values.items()]


@pytest.mark.job
def test_train_dpo_learns_resumes_exactly_after_sigkill_and_is_where_grpo_starts(facts_pairs, tmp_path):
    """The whole job is SIGKILLed once step 3 is logged (the checkpoint is at step 2); resumed, it redoes step 3
    and every step's metrics, held-out ones included, equal those of a run never interrupted."""
    from mindrl.checkpoint import megatron as mg

    tokenizer, data = facts_pairs
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    six = {"megatron_training.train_iters": 6, "dpo_config.test_interval": 3}
    jobs.run("train_dpo.py", "dpo_facts_cpu", _dpo_overrides(tokenizer, data, whole, **six), tmp_path / "whole.log")
    log = tmp_path / "cut.log"
    job = jobs.start("train_dpo.py", "dpo_facts_cpu", _dpo_overrides(tokenizer, data, cut, **six), log)
    logged = cut / "metrics.jsonl"
    jobs.kill_when(job, lambda: logged.is_file() and len(logged.read_text().splitlines()) >= 3, log)
    assert mg.read_tracker(cut) == 2
    jobs.run("train_dpo.py", "dpo_facts_cpu", _dpo_overrides(tokenizer, data, cut, **six, **{
        "megatron_training.load": cut}), log)
    assert f"resumed from {cut} at iteration 2 (epoch 0, pair 16)" in log.read_text()
    expected, got = jobs.metrics(whole / "metrics.jsonl"), jobs.metrics(cut / "metrics.jsonl")
    assert [line["step"] for line in got] == [1, 2, 3, 4, 5, 6]
    assert jobs.run_values(got) == jobs.run_values(expected)
    first = expected[0]
    # step 1: the policy is its reference, so every implicit reward is 0 and the loss is log 2
    assert first["dpo/loss"] == pytest.approx(0.6931472, abs=1e-6) and first["rewards/margins"] == 0.0
    # learning, on the held-out pairs (a training batch of 8 pairs, scored before its own update, is noisier):
    # measured 0.630 -> 0.597 loss and 0.139 -> 0.210 margin from step 3 to 6, 14 of 16 pairs ranked right
    held_out = [line for line in expected if "validation/rewards/accuracies" in line]
    assert [line["step"] for line in held_out] == [3, 6]
    early, late = held_out
    assert late["validation/dpo/loss"] < early["validation/dpo/loss"] < 0.6931472
    assert late["validation/rewards/margins"] > early["validation/rewards/margins"] > 0
    assert late["validation/rewards/accuracies"] > 0.5
    assert (whole / "hf" / "config.json").is_file()
    # another reference than the start weights (ref_model): the same policy, so the same log-probs at step 1,
    # but implicit rewards against the trained checkpoint, no longer 0; with RPO's NLL term the same preference
    # loss, and the chosen answers' NLL per token logged beside it
    jobs.run("train_dpo.py", "dpo_facts_cpu", _dpo_overrides(tokenizer, data, tmp_path / "other", **{
        "megatron_training.train_iters": 1, "dpo_config.ref_model": whole, "dpo_config.rpo_alpha": 1.0,
        "dpo_config.test_interval": 1}), tmp_path / "other.log")
    (other,) = jobs.metrics(tmp_path / "other" / "metrics.jsonl")
    assert other["logps/chosen"] == first["logps/chosen"] and other["rewards/chosen"] != 0.0
    assert other["dpo/nll_loss"] > 0 and "dpo/nll_loss" not in first
    # held out: the chosen answers' NLL per token is their mean sequence log-prob over their mean length
    held_out_pairs, _ = read_pairs(data / "test.parquet", 64)
    chosen_tokens = sum(len(p.chosen_ids) for p in held_out_pairs[:16])  # the two whole batches of 8 pairs
    assert other["validation/dpo/nll_loss"] == pytest.approx(-other["validation/logps/chosen"] * 16 / chosen_tokens,
                                                              rel=1e-5)
    base = load_dpo_config("dpo_facts_cpu").training
    loaded = dataclasses.replace(base, load=str(whole))
    assert start_point(loaded, JOB_DPO).resume == str(whole)  # DPO resumes its own checkpoint ...
    grpo = start_point(loaded, JOB_GRPO)  # ... which GRPO takes as its start weights (and reference), at step 0
    assert (grpo.iteration, grpo.initial_weights, grpo.resume) == (0, str(whole), None)
