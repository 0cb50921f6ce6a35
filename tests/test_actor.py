"""Megatron actor / reference workers: log-probs vs HF, layout-invariant updates, direction, offload."""

import pytest
import torch

from mindrl.algorithms.policy_loss import LossConfig
from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker, MegatronWorker
from tests.hf_models import build_hf_model, save_hf_model
from mindrl.ckpt_convert import hf_to_mcore

TEMPERATURE = 0.7


def _batch(vocab: int, rows: int = 4, seq: int = 20, prompt: int = 8, seed: int = 3) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq), generator=gen)
    loss_mask = torch.zeros(rows, seq)
    for r in range(rows):  # responses of different lengths, right-padded
        loss_mask[r, prompt - 1:seq - 1 - r] = 1
    return {"tokens": tokens, "loss_mask": loss_mask}


def _reference_log_probs(rank: int, checkpoint: str, batch: dict) -> dict | None:
    from mindrl.checkpoint import megatron as mg

    args = mg.load_args(checkpoint)
    worker = MegatronWorker(mg.arch_of(args), mg.parallel_of(args), weights=checkpoint, temperature=TEMPERATURE)
    return worker.compute_log_prob(batch, with_entropy=True)


def test_tp2_log_probs_and_entropy_equal_hf(tmp_path):
    model = build_hf_model("qwen2", seed=7)
    checkpoint = hf_to_mcore(save_hf_model(model, tmp_path / "hf"), tmp_path / "mg", "qwen2", 2, 1,
                             params_dtype=torch.float32, progress=False)
    batch = _batch(250)
    with torch.no_grad():
        logits = model(batch["tokens"]).logits / TEMPERATURE
    log_softmax = torch.log_softmax(logits, dim=-1)
    expected = log_softmax[:, :-1].gather(-1, batch["tokens"][:, 1:].unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(log_softmax.exp() * log_softmax).sum(-1)[:, :-1]
    ranks = run_ranks(_reference_log_probs, 2, str(checkpoint), batch)
    assert all(r is not None for r in ranks)  # PP=1: both TP ranks are on the last stage
    got = ranks[0]["log_probs"][:, :-1]
    mask = batch["loss_mask"][:, :-1].bool()
    assert (got - expected)[mask].abs().max().item() < 1e-5
    assert (ranks[0]["entropy"][:, :-1] - expected_entropy).abs().max().item() < 1e-5
    assert torch.equal(ranks[0]["log_probs"], ranks[1]["log_probs"])


ACTOR = ActorConfig(lr=1e-4, mini_batch_size=8, micro_batch_size=2, temperature=1.0,
                    loss=LossConfig(clip_ratio=0.2, loss_agg_mode="token-mean", use_kl_loss=True, kl_coef=0.1,
                                    entropy_coeff=0.01))


def _update_batch(vocab: int) -> dict:
    batch = _batch(vocab, rows=8, seq=16, prompt=6)
    gen = torch.Generator().manual_seed(9)
    batch["old_log_probs"] = torch.full((8, 16), -6.9) + 0.05 * torch.randn(8, 16, generator=gen)
    batch["ref_log_probs"] = torch.full((8, 16), -6.95)
    batch["advantages"] = torch.randn(8, 1, generator=gen).expand(8, 16) * batch["loss_mask"]
    return batch


def _update_layouts(rank: int, layouts: list) -> list:
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=4)
    out = []
    for par in layouts:
        worker = ActorWorker(arch, par, ACTOR, weights=full)
        metrics = worker.update(_update_batch(arch.padded_vocab_size))
        out.append({"tp": worker.tp_rank, "pp": worker.pp_rank, "dp": worker.dp_rank, "metrics": metrics,
                    "params": {n: p.detach().clone() for n, p in worker.model.named_parameters()}})
    return out


def test_one_update_at_tp2_and_pp2_matches_tp1():
    arch = load_model_arch("tiny_qwen")
    layouts = [ParallelConfig(1, 1), ParallelConfig(2, 1), ParallelConfig(1, 2)]
    per_rank = run_ranks(_update_layouts, 4, layouts)
    initial = sharding.random_full_state_dict(arch, seed=4)
    merged = []
    for i, par in enumerate(layouts):
        stages = {(r[i]["tp"], r[i]["pp"]): r[i]["params"] for r in per_rank if r[i]["dp"] == 0}
        merged.append(sharding.merge_state_dicts(stages, arch, par))
    for name, ref in merged[0].items():
        assert not torch.equal(ref, initial[name]) or "layernorm" in name, f"{name} did not move"
        for other, par in zip(merged[1:], layouts[1:], strict=True):
            assert (other[name] - ref).abs().max().item() < 1e-5, f"{name} at TP={par.tp} PP={par.pp}"
    last = [r[0]["metrics"] for r in per_rank if r[0]["pp"] == 0]
    assert {"pg_loss", "kl_loss", "entropy", "clip_fraction", "grad_norm", "lr"} <= set(last[0])
    assert last[0]["lr"] == pytest.approx(1e-4) and last[0]["grad_norm"] > 0


def _direction(rank: int, sign: float) -> tuple[float, float]:
    arch = load_model_arch("tiny_qwen")
    cfg = ActorConfig(lr=1e-3, mini_batch_size=2, micro_batch_size=2, loss=LossConfig())
    worker = ActorWorker(arch, ParallelConfig(1, 1), cfg, weights=sharding.random_full_state_dict(arch, seed=5))
    batch = _batch(arch.padded_vocab_size, rows=2, seq=12, prompt=5)
    before = worker.compute_log_prob(batch)["log_probs"]
    batch["old_log_probs"] = before
    batch["advantages"] = torch.tensor([[sign], [0.0]]).expand(2, 12) * batch["loss_mask"]
    for _ in range(3):
        worker.update(batch)
    after = worker.compute_log_prob(batch)["log_probs"]
    mask = batch["loss_mask"].bool()
    return (after[0][mask[0]].sum() - before[0][mask[0]].sum()).item(), (after - before).abs().max().item()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_advantage_sign_moves_the_response_log_prob(sign):
    change, largest = run_ranks(_direction, 1, sign)[0]
    assert largest > 0
    assert change * sign > 0.1, change


def _offload_round_trip(rank: int) -> dict:
    arch = load_model_arch("tiny_qwen")
    batch = _update_batch(arch.padded_vocab_size)
    results = {}
    for offload in (False, True):
        worker = ActorWorker(arch, ParallelConfig(1, 1), ACTOR, weights=sharding.random_full_state_dict(arch, seed=4))
        worker.update(batch)
        if offload:
            freed = worker.offload(params=True, grads=True, optimizer=True)
            results["freed"] = freed
            results["empty"] = all(p.untyped_storage().nbytes() == 0 for p in worker.model.parameters())
            results["restored"] = worker.onload()
        worker.update(batch)
        results[offload] = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
        results[f"optim_{offload}"] = [t.detach().clone() for t in worker._optimizer_tensors()]
    return results


def test_offload_onload_leaves_training_bit_identical():
    out = run_ranks(_offload_round_trip, 2)  # DP=2: distributed-optimizer shards are offloaded too
    for result in out:
        params_bytes = sum(p.numel() * 4 for p in result[True].values())
        assert result["freed"] >= params_bytes  # params + grads + optimizer state, at least the params
        assert result["restored"] == result["freed"] and result["empty"]
        for name in result[False]:
            assert torch.equal(result[False][name], result[True][name]), name
        for a, b in zip(result["optim_False"], result["optim_True"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, message", [
    (dict(mini_batch_size=6, micro_batch_size=4), "mini_batch_size=6 is not a multiple of micro_batch_size=4"),
    (dict(lr_decay_style="step"), "lr_decay_style must be constant, cosine or linear"),
    (dict(lr_warmup_fraction=1.0), r"lr_warmup_fraction must be in \[0, 1\)"),
    (dict(temperature=0.0), "temperature must be positive"),
    (dict(micro_batch_size=0), "micro_batch_size must be a positive integer, got 0"),
    (dict(epochs=0), "epochs must be a positive integer"),
])
def test_actor_config_mistakes_are_one_sentence(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ActorConfig(**kwargs)
