"""PPO's critic worker: its value-loss gradients at TP=2 (also sequence-parallel), PP=2 and DP=2 (plain and
prompt-packed rows) against HF transformers' model with the loss written out, its values at TP=2×PP=2, and a critic
started from a causal LM's converted checkpoint."""

import pytest
import torch
import transformers

from mindrl.algorithms.value_loss import ValueLossConfig
from mindrl.config import ParallelConfig, load_model_arch
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import hf_mapping as hfm
from mindrl.models import sharding
from mindrl.workers.critic_worker import CriticWorker, critic_arch
from mindrl.workers.megatron_worker import ActorConfig
from tests.grads import assert_gradients_equal, reduced_grads
from tests.hf_models import mcore_to_hf_state

# (layout, micro-batch, prompt packing): TP=2, PP=2 and DP=2 on two ranks, each in several micro-batches
LAYOUTS = [(ParallelConfig(2, 1), 4, "on"), (ParallelConfig(1, 2), 2, "off"), (ParallelConfig(1, 1), 2, "on"),
           (ParallelConfig(2, 1, sequence_parallel=True), 4, "off")]  # the score head sees every TP rank's shard
CLIP = 0.2


def _batch(vocab: int) -> dict:
    """4 prompts of 2 samples each (rows sharing a prompt pack behind one copy of it), responses of different
    lengths; old values about the clip range away from the random model's (near 0), so that some tokens are
    clipped and some not."""
    gen = torch.Generator().manual_seed(21)
    rows, width = 8, 14
    tokens = torch.zeros(rows, width, dtype=torch.int64)
    mask = torch.zeros(rows, width)
    prompts, responses = [], []
    for row in range(rows):
        if row % 2 == 0:
            prompt = torch.randint(0, vocab, (int(torch.randint(2, 5, (1,), generator=gen)),), generator=gen)
        length = int(torch.randint(1, width - len(prompt), (1,), generator=gen))
        tokens[row, :len(prompt)] = prompt
        tokens[row, len(prompt):len(prompt) + length] = torch.randint(0, vocab, (length,), generator=gen)
        mask[row, len(prompt) - 1:len(prompt) - 1 + length] = 1  # position t values the state predicting t + 1
        prompts.append(len(prompt))
        responses.append(length)
    returns = torch.randn(rows, width, generator=gen)
    return {"tokens": tokens, "loss_mask": mask, "returns": returns, "prompt_lengths": torch.tensor(prompts),
            "response_lengths": torch.tensor(responses), "values": 0.25 * torch.randn(rows, width, generator=gen)}


def _hf_critic(arch, full: dict) -> transformers.PreTrainedModel:
    config = transformers.Qwen2Config(**hfm.hf_config_from_arch(arch, "qwen2", torch.float32))
    model = transformers.Qwen2ForSequenceClassification(config)
    model.load_state_dict(mcore_to_hf_state(full, arch))
    return model


def _hf_values(model: transformers.PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    """Every position's value: HF's score head on every hidden state (its forward pools the last one only)."""
    return model.score(model.model(tokens).last_hidden_state)[..., 0]


def _critic_grads(rank: int, full: dict) -> list[dict]:
    arch = load_model_arch("tiny_qwen")
    batch = _batch(arch.padded_vocab_size)
    out = []
    for par, micro, packing in LAYOUTS:
        release_model_parallel()
        cfg = ActorConfig(lr=1e-3, mini_batch_size=8, micro_batch_size=micro, clip_grad=1e9, prompt_packing=packing)
        worker = CriticWorker(arch, par, cfg, ValueLossConfig(cliprange_value=CLIP), weights=full)
        values = worker.compute_values(batch)
        packed = worker.packed
        metrics = worker.update(batch)
        out.append({"tp": worker.tp_rank, "pp": worker.pp_rank, "dp": worker.dp_rank, "metrics": metrics,
                    "values": values, "rows": worker.local_rows(8), "grads": reduced_grads(worker),
                    "packed": (packed, worker.packed)})
    return out


def test_critic_gradients_equal_hf_transformers_with_the_clipped_value_loss_at_tp2_pp2_and_dp2():
    """The oracle: HF's Qwen2ForSequenceClassification trunk and score head at every position, and the clipped
    value loss written out (½ · token-mean of max((v − R)², (clip(v, v_old ± c) − R)²)), autograd."""
    arch = critic_arch(load_model_arch("tiny_qwen"))
    full = sharding.random_full_state_dict(arch, seed=8)
    model = _hf_critic(arch, full)
    batch = _batch(arch.padded_vocab_size)
    values = _hf_values(model, batch["tokens"])
    old, returns, mask = batch["values"], batch["returns"], batch["loss_mask"]
    clipped = old + (values - old).clamp(-CLIP, CLIP)
    errors = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    loss = 0.5 * (errors * mask).sum() / mask.sum()
    loss.backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    clipfrac = (((clipped - returns) ** 2 > (values - returns) ** 2).float() * mask).sum() / mask.sum()
    assert 0.1 < clipfrac < 0.9  # both branches of the clip are exercised
    ranks = run_ranks(_critic_grads, 2, full)
    for index, (par, micro, packing) in enumerate(LAYOUTS):
        runs = [r[index] for r in ranks]
        where = f"TP={par.tp} PP={par.pp} SP={par.sequence_parallel} micro={micro} packing={packing}"
        assert all(run["packed"] == (packing == "on",) * 2 for run in runs), where
        assert_gradients_equal(runs, expected, arch, par, where)
        for run in runs:
            assert run["metrics"]["vf_loss"] == pytest.approx(loss.item(), rel=1e-5), where
            assert run["metrics"]["vf_clipfrac"] == pytest.approx(clipfrac.item(), abs=1e-6), where
            if run["values"] is not None:  # packed rows give the response positions' values only
                rows = run["rows"]
                assert ((run["values"] - values[rows].detach()) * mask[rows]).abs().max() <= 1e-5, where
    assert expected["score.weight"].abs().max() > 1e-4


def _values_from_checkpoint(rank: int, root: str, critic_root: str, tokens: torch.Tensor) -> dict:
    from mindrl.checkpoint import megatron as mg

    arch = mg.arch_of(mg.load_args(root), root)
    cfg = ActorConfig(mini_batch_size=4, micro_batch_size=2, prompt_packing="off")
    worker = CriticWorker(arch, ParallelConfig(2, 2), cfg, ValueLossConfig(), weights=root)
    values = worker.compute_values({"tokens": tokens})
    head = worker.model.rm_head.weight.detach().clone() if worker.is_last_stage else None
    # a critic checkpoint (a reward model's layout, value head included) starts the next critic as it was
    worker.save_checkpoint(critic_root, 1, extra={})
    release_model_parallel()
    again = CriticWorker(arch, ParallelConfig(2, 2), cfg, ValueLossConfig(), weights=critic_root)
    same = all(torch.equal(p, q) for p, q in zip(worker.model.parameters(), again.model.parameters(), strict=True))
    return {"values": values, "head": head, "rows": worker.local_rows(tokens.shape[0]), "same": same,
            "names": sorted(name for name, _ in worker.model.named_parameters())}


def test_a_critic_started_from_a_causal_lm_checkpoint_keeps_its_trunk_at_tp2_pp2(tmp_path):
    """The actor's converted checkpoint (an LM head, no value head) at TP=2 PP=2 on four ranks: the critic takes
    the trunk, drops the LM head and initialises its own; its values equal HF's trunk times that head. Its own
    checkpoint then starts another critic with every tensor, head included, and converts to HF as the reward
    model it is: Qwen2ForSequenceClassification, whose score head at every position gives the same values."""
    from mindrl.ckpt_convert import hf_to_mcore, mcore_to_hf
    from tests.hf_models import build_hf_model, save_hf_model

    model = build_hf_model("qwen2", seed=3)
    root = hf_to_mcore(save_hf_model(model, tmp_path / "hf"), tmp_path / "mg", "qwen2", 2, 2,
                       params_dtype=torch.float32, progress=False)
    tokens = torch.randint(0, model.config.vocab_size, (4, 10), generator=torch.Generator().manual_seed(4))
    ranks = run_ranks(_values_from_checkpoint, 4, str(root), str(tmp_path / "critic"), tokens)
    assert all(r["same"] for r in ranks)
    heads = [r["head"] for r in ranks if r["head"] is not None]
    assert len(heads) == 2 and torch.equal(heads[0], heads[1])  # one head, replicated on both TP ranks
    assert heads[0].abs().max() > 0 and all("output_layer.weight" not in r["names"] for r in ranks)
    with torch.no_grad():
        expected = model.model(tokens).last_hidden_state @ heads[0][0]
    held = [r for r in ranks if r["values"] is not None]
    assert sorted((r["rows"].start, r["rows"].stop) for r in held) == [(0, 4), (0, 4)]  # DP=1: both TP ranks
    for run in held:
        assert (run["values"] - expected).abs().max() <= 1e-5
    exported = mcore_to_hf(tmp_path / "critic", tmp_path / "critic_hf", progress=False)
    reward_model = transformers.AutoModelForSequenceClassification.from_pretrained(exported, dtype=torch.float32)
    assert type(reward_model).__name__ == "Qwen2ForSequenceClassification"
    assert torch.equal(reward_model.score.weight.detach(), heads[0])
    with torch.no_grad():
        assert (_hf_values(reward_model, tokens) - held[0]["values"]).abs().max() <= 1e-5
