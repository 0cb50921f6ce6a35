"""Megatron actor / reference workers: log-probs vs HF, layout-invariant updates, direction, offload."""

import dataclasses
import math

import pytest
import torch

from mindrl.algorithms.policy_loss import LossConfig
from mindrl.ckpt_convert import hf_to_mcore
from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker, MegatronWorker
from mindrl.workers.offload import storage_keys
from tests.grads import reduced_grads
from tests.hf_models import build_hf_model, save_hf_model

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


def _pipelined_log_probs(rank: int, checkpoint: str, batch: dict) -> dict | None:
    from mindrl.checkpoint import megatron as mg

    args = mg.load_args(checkpoint)
    worker = MegatronWorker(mg.arch_of(args), mg.parallel_of(args), weights=checkpoint, temperature=TEMPERATURE,
                            micro_batch_size=4)
    return worker.compute_log_prob(batch, with_entropy=True)


def test_pp2_log_probs_equal_hf_with_a_short_last_micro_batch(tmp_path):
    """PP=2 with a tied embedding split over stages; 6 rows in micro-batches of 4 (the last one short)."""
    model = build_hf_model("qwen2", seed=7)
    checkpoint = hf_to_mcore(save_hf_model(model, tmp_path / "hf"), tmp_path / "mg", "qwen2", 1, 2,
                             params_dtype=torch.float32, progress=False)
    batch = _batch(250, rows=6)
    with torch.no_grad():
        log_softmax = torch.log_softmax(model(batch["tokens"]).logits / TEMPERATURE, dim=-1)
    expected = log_softmax[:, :-1].gather(-1, batch["tokens"][:, 1:].unsqueeze(-1)).squeeze(-1)
    first, last = run_ranks(_pipelined_log_probs, 2, str(checkpoint), batch)
    assert first is None and last["log_probs"].shape == (6, 20)
    assert (last["log_probs"][:, :-1] - expected).abs().max().item() < 1e-5
    assert (last["entropy"][:, :-1] + (log_softmax.exp() * log_softmax).sum(-1)[:, :-1]).abs().max().item() < 1e-5


def _lr_steps(rank: int, schedule: dict, updates: int) -> list:
    arch = load_model_arch("tiny_qwen")
    cfg = ActorConfig(lr=1e-3, lr_warmup_fraction=0.5, lr_decay_iters=4, mini_batch_size=4, micro_batch_size=2,
                      **schedule)
    worker = ActorWorker(arch, ParallelConfig(1, 1), cfg, weights=sharding.random_full_state_dict(arch, seed=5))
    batch = _update_batch(arch.padded_vocab_size)
    steps = []
    for _ in range(updates):
        before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
        metrics = worker.update({k: v[:4] for k, v in batch.items()})
        moved = max((p.detach() - before[n]).abs().max().item() for n, p in worker.model.named_parameters())
        steps.append((metrics["lr"], moved))
    return steps


def test_the_reported_lr_is_the_one_the_step_used():
    """Warm-up over 2 steps from 0: the first step runs at lr 0 (nothing moves), then 5e-4, then 1e-3."""
    steps = run_ranks(_lr_steps, 1, {}, 3)[0]
    assert [lr for lr, _ in steps] == pytest.approx([0.0, 5e-4, 1e-3])
    assert steps[0][1] == 0.0 and steps[1][1] > 0 and steps[2][1] > 0


def test_lr_decays_to_min_lr():
    """Cosine decay after the warm-up: half-way 1e-4 + 0.5 × 9e-4, then min_lr, and min_lr after the end."""
    steps = run_ranks(_lr_steps, 1, {"lr_decay_style": "cosine", "min_lr": 1e-4}, 5)[0]
    assert [lr for lr, _ in steps] == pytest.approx([0.0, 5e-4, 1e-3, 5.5e-4, 1e-4])


def _lr_by_iteration(rank: int, iterations: int) -> list[float]:
    arch = load_model_arch("tiny_qwen")
    cfg = ActorConfig(lr=1e-3, min_lr=1e-4, lr_decay_style="cosine", lr_warmup_fraction=0.25, lr_decay_iters=4,
                      steps_per_iteration=4, epochs=2, mini_batch_size=4, micro_batch_size=2)
    worker = ActorWorker(arch, ParallelConfig(1, 1), cfg, weights=sharding.random_full_state_dict(arch, seed=5))
    batch = _update_batch(arch.padded_vocab_size)  # 8 rows: 2 mini-batches × 2 epochs = 4 optimizer steps
    return [worker.update(batch)["lr"] for _ in range(iterations)]


def test_the_lr_schedule_counts_iterations_however_many_optimizer_steps_each_takes():
    """lr_decay_iters and the warm-up fraction are in iterations (as the keys say, and as Megatron means them):
    with 4 optimizer steps an iteration, the schedule ends after lr_decay_iters iterations, not a quarter of
    them. Step k of iteration i uses the rate at i − 1 + k/4 iterations; the reported lr is their mean."""
    lr, low, warmup, decay = 1e-3, 1e-4, 1.0, 4.0

    def by_hand(x: float) -> float:
        if x <= warmup:
            return lr * x / warmup
        if x > decay:
            return low
        return low + (lr - low) * 0.5 * (1 + math.cos(math.pi * (x - warmup) / (decay - warmup)))

    expected = [sum(by_hand(i + k / 4) for k in range(4)) / 4 for i in range(6)]
    assert run_ranks(_lr_by_iteration, 1, 6)[0] == pytest.approx(expected, rel=1e-6)


def _weighted_updates(rank: int) -> list[dict]:
    """The same first update without importance weights, with weights of 1 and with weights of 2."""
    arch = load_model_arch("tiny_qwen")
    batch = _update_batch(arch.padded_vocab_size)
    out = []
    for weights in (None, 1.0, 2.0):
        worker = ActorWorker(arch, ParallelConfig(1, 1), ACTOR, weights=sharding.random_full_state_dict(arch, seed=5))
        extra = {} if weights is None else {"rollout_is_weights": torch.full_like(batch["loss_mask"], weights)}
        out.append(worker.update({**batch, **extra}))
    return out


def test_rollout_is_weights_scale_the_policy_gradient_loss():
    plain, ones, twos = run_ranks(_weighted_updates, 1)[0]
    assert ones == plain
    assert twos["pg_loss"] == pytest.approx(2 * plain["pg_loss"], rel=1e-6)


def _training_state(worker: ActorWorker) -> list[torch.Tensor]:
    """The model's weights, the optimizer's fp32 masters and Adam's moments and step, and the schedule's step."""
    return ([p.detach().clone() for p in worker.model.parameters()] +
            [t.detach().clone() for t in worker._optimizer_tensors()] + [torch.tensor(worker.scheduler.num_steps)])


def _unchanged(before: list[torch.Tensor], worker: ActorWorker) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, _training_state(worker), strict=True))


def _nonfinite_updates(rank: int) -> dict:
    """DP=2, one optimizer step per update: a finite update (so Adam has moments), one where rank 1 alone has NaN
    gradients in one weight, one with a NaN advantage in one of rank 1's rows, then a finite one again."""
    arch = load_model_arch("tiny_qwen")
    worker = ActorWorker(arch, ParallelConfig(1, 1), ACTOR, weights=sharding.random_full_state_dict(arch, seed=5))
    batch = _update_batch(arch.padded_vocab_size)
    out = {"first": worker.update(batch)}
    before = _training_state(worker)
    weight = list(worker.model.parameters())[-1]
    hook = weight.register_hook(lambda grad: torch.full_like(grad, math.nan)) if rank == 1 else None
    out["nan_grads"] = worker.update(batch)
    if hook is not None:
        hook.remove()
    out["unchanged_after_nan_grads"] = _unchanged(before, worker)
    bad = {**batch, "advantages": batch["advantages"].clone()}
    bad["advantages"][6, 7] = math.nan  # row 6 is rank 1's, position 7 a response token of it
    out["nan_loss"] = worker.update(bad)
    out["unchanged_after_nan_loss"] = _unchanged(before, worker)
    out["last"] = worker.update(batch)
    out["moved_after"] = not _unchanged(before, worker)
    out["finite_after"] = all(torch.isfinite(t).all().item() for t in _training_state(worker))
    return out


def test_a_nan_in_one_ranks_gradients_or_in_the_loss_skips_the_step_on_every_rank_and_the_next_one_trains():
    for rank, out in enumerate(run_ranks(_nonfinite_updates, 2)):
        assert out["first"]["skipped"] == 0.0 and math.isfinite(out["first"]["grad_norm"])
        grads, loss = out["nan_grads"], out["nan_loss"]
        assert grads["skipped"] == 1.0 and grads["nonfinite_loss"] == 0.0 and math.isnan(grads["grad_norm"]), rank
        assert math.isfinite(grads["pg_loss"])  # the loss was fine: the gradients were not
        assert out["unchanged_after_nan_grads"], f"rank {rank}: weights, Adam state or schedule moved"
        assert loss["skipped"] == 1.0 and loss["nonfinite_loss"] == 1.0 and math.isnan(loss["pg_loss"]), rank
        assert out["unchanged_after_nan_loss"], f"rank {rank}: weights, Adam state or schedule moved"
        assert out["last"]["skipped"] == 0.0 and math.isfinite(out["last"]["grad_norm"])
        assert out["moved_after"] and out["finite_after"]


def _shape_mistakes(rank: int) -> list[str]:
    arch = load_model_arch("tiny_qwen")
    batch = _update_batch(arch.padded_vocab_size)
    messages = []
    try:  # DP=2: 6 samples per mini-batch give each rank 3, not a whole number of micro-batches of 2
        ActorWorker(arch, ParallelConfig(1, 1), ActorConfig(mini_batch_size=6, micro_batch_size=2))
    except ConfigError as err:
        messages.append(str(err))
    worker = ActorWorker(arch, ParallelConfig(1, 1), ACTOR)
    for broken in ({k: v for k, v in batch.items() if k != "advantages"},
                   {**batch, "old_log_probs": batch["old_log_probs"][:, :-1]},
                   {k: v[:6] for k, v in batch.items()},
                   {k: v[:3] for k, v in batch.items()}):
        try:
            worker.update(broken)
        except (ConfigError, ValueError) as err:
            messages.append(str(err))
    try:
        worker.compute_log_prob({"tokens": batch["tokens"][:3]})
    except ConfigError as err:
        messages.append(str(err))
    return messages


def test_batch_shape_mistakes_are_one_sentence_before_any_forward():
    messages = run_ranks(_shape_mistakes, 2)[0]
    assert messages == [
        "mini_batch_size=6 over 2 data-parallel ranks does not give each rank a whole number of micro-batches of "
        "micro_batch_size=2; make mini_batch_size a multiple of 4.",
        "batch lacks 'advantages', a [batch, sequence] tensor like its tokens.",
        "batch['old_log_probs'] has shape (8, 15) but the tokens have (8, 16); give one value per token position.",
        "batch of 6 rows is not a whole number of mini-batches of mini_batch_size=8; make the rows a multiple of it.",
        "batch of 3 rows is not a whole number of mini-batches of mini_batch_size=8; make the rows a multiple of it.",
        "batch of 3 rows does not split over 2 data-parallel ranks; make the number of rows a multiple of 2.",
    ]


def _bf16_step(rank: int) -> dict:
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=4)
    batch = _update_batch(arch.padded_vocab_size)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        release_model_parallel()
        worker = ActorWorker(arch, ParallelConfig(1, 1), ACTOR, weights=full, params_dtype=dtype)
        main_before = [p.detach().clone() for g in worker.optimizer.param_groups for p in g["params"]]
        out[dtype] = {"log_probs": worker.compute_log_prob(batch)["log_probs"], "metrics": worker.update(batch),
                      "grads": reduced_grads(worker), "param_dtypes": {p.dtype for p in worker.model.parameters()},
                      "model_numel": sum(p.numel() for p in worker.model.parameters())}
        main_after = [p.detach() for g in worker.optimizer.param_groups for p in g["params"]]
        out[dtype]["main_dtypes"] = {p.dtype for p in main_after}
        out[dtype]["main_numel"] = sum(p.numel() for p in main_after)
        out[dtype]["main_moved"] = max((a - b).abs().max().item() for a, b in zip(main_after, main_before, strict=True))
    return out


def test_bf16_actor_keeps_fp32_main_params_and_follows_the_fp32_gradient():
    out = run_ranks(_bf16_step, 2)  # DP=2: the distributed optimizer shards the fp32 main params
    mask = _update_batch(1024)["loss_mask"].bool()
    for rank, result in enumerate(out):
        fp32, bf16 = result[torch.float32], result[torch.bfloat16]
        assert bf16["param_dtypes"] == {torch.bfloat16} and bf16["main_dtypes"] == {torch.float32}
        assert 0 < bf16["main_moved"] < 1e-3  # Adam moved the fp32 masters by about lr
        rows = mask[4 * rank:4 * rank + 4]
        assert (bf16["log_probs"] - fp32["log_probs"])[rows].abs().max().item() < 0.05
        for key in ("pg_loss", "kl_loss", "entropy", "grad_norm"):
            assert bf16["metrics"][key] == pytest.approx(fp32["metrics"][key], rel=0.02, abs=1e-3), key
        g32 = torch.cat([g.flatten() for g in fp32["grads"].values()])
        g16 = torch.cat([g.flatten() for g in bf16["grads"].values()])
        assert g16.dtype == torch.float32  # gradients reduce in fp32
        assert torch.nn.functional.cosine_similarity(g32, g16, dim=0).item() > 0.99
    # Each rank holds a shard of the fp32 masters, together exactly one copy of the model.
    assert sum(r[torch.bfloat16]["main_numel"] for r in out) == out[0][torch.bfloat16]["model_numel"]


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


def _entropy_without_bonus(rank: int) -> dict:
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=4)
    batch = _update_batch(arch.padded_vocab_size)
    out = {}
    for coeff in (0.0, 0.01):
        release_model_parallel()
        cfg = ActorConfig(lr=1e-4, mini_batch_size=8, micro_batch_size=2,
                          loss=LossConfig(clip_ratio=0.2, entropy_coeff=coeff))
        worker = ActorWorker(arch, ParallelConfig(1, 1), cfg, weights=full)
        entropy = worker.compute_log_prob(batch, with_entropy=True)["entropy"]
        worker._backward(batch, torch.arange(8), worker._policy_loss, False)
        unmeasured = reduced_grads(worker)
        worker._backward(batch, torch.arange(8), worker._policy_loss, True)
        out[coeff] = {"grads": reduced_grads(worker), "unmeasured": unmeasured, "metrics": worker.update(batch),
                      "entropy": entropy}
    return out


def test_entropy_is_logged_without_the_bonus_and_takes_gradient_only_with_it():
    """entropy_coeff 0 (the default) still reports actor/entropy, the collapse signal, computed without a graph:
    the gradient is the policy loss's alone; with a bonus the gradient changes by it."""
    out = run_ranks(_entropy_without_bonus, 1)[0]
    mask = _update_batch(1024)["loss_mask"].bool()
    for coeff in (0.0, 0.01):
        expected = out[coeff]["entropy"][mask].mean().item()
        assert out[coeff]["metrics"]["entropy"] == pytest.approx(expected, rel=1e-5)
    grads = [torch.cat([g.flatten() for g in out[c]["grads"].values()]) for c in (0.0, 0.01)]
    assert torch.equal(grads[0], torch.cat([g.flatten() for g in out[0.0]["unmeasured"].values()]))
    assert not torch.equal(grads[0], grads[1])


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


def _swapped_optimizer(rank: int, root: str) -> dict:
    """Two updates (with a rollout's offload and onload between them) and a save, then a load into a new worker, with
    and without swap_optimizer, in fp32 (the masters are views of the weights) and bf16 (masters of their own)."""
    arch = load_model_arch("tiny_qwen")
    batch = _update_batch(arch.padded_vocab_size)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for swap in (False, True):
            release_model_parallel()
            cfg = dataclasses.replace(ACTOR, swap_optimizer=swap)
            weights = sharding.random_full_state_dict(arch, seed=4)
            worker = ActorWorker(arch, ParallelConfig(1, 1), cfg, weights=weights, params_dtype=dtype)
            params = storage_keys(worker.model.parameters())
            own = [t for t in worker._optimizer_tensors() if storage_keys([t]) - params]  # bf16: the masters
            off = [all(t.untyped_storage().nbytes() == 0 for t in own)]  # before any step
            worker.update(batch)
            own = [t for t in worker._optimizer_tensors() if storage_keys([t]) - params]  # and Adam's moments
            off.append(all(t.untyped_storage().nbytes() == 0 for t in own))
            worker.offload(params=True, grads=True, optimizer=False)
            worker.onload()  # the rollout's round trip leaves a swapped optimizer state where it was
            off.append(all(t.untyped_storage().nbytes() == 0 for t in own))
            worker.update(batch)
            folder = f"{root}/{dtype}-{swap}"
            worker.save_checkpoint(folder, 2)
            off.append(all(t.untyped_storage().nbytes() == 0 for t in own))
            worker.offloader.onload()
            trained = _training_state(worker)
            release_model_parallel()
            loaded = ActorWorker(arch, ParallelConfig(1, 1), cfg, weights=weights, params_dtype=dtype)
            loaded.load_checkpoint(folder)
            own = [t for t in loaded._optimizer_tensors()
                   if storage_keys([t]) - storage_keys(loaded.model.parameters())]
            off.append(all(t.untyped_storage().nbytes() == 0 for t in own))
            loaded.offloader.onload()
            results[(str(dtype), swap)] = {"state": _training_state(loaded), "trained": trained, "off": off,
                                           "own": len(own)}
    return results


def test_swap_optimizer_keeps_the_optimizer_state_in_host_memory_and_trains_bit_identically(tmp_path):
    """MindSpeed's swap_optimizer: the optimizer's own state is on the device only for the step, a save and a load;
    the weights, Adam's moments and the schedule come out bit for bit as without it, and so does a checkpoint."""
    out = run_ranks(_swapped_optimizer, 2, str(tmp_path))  # DP=2: the distributed optimizer's shards swap
    for result in out:
        for dtype in ("torch.float32", "torch.bfloat16"):
            plain, swapped = result[(dtype, False)], result[(dtype, True)]
            assert swapped["off"] == [True] * 5 and not any(plain["off"][1:2]) and swapped["own"] > 0
            for key in ("trained", "state"):  # after two updates, and loaded from their checkpoints
                for a, b in zip(plain[key], swapped[key], strict=True):
                    assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, message", [
    (dict(swap_optimizer=True, async_save=True, ckpt_format="torch_dist"),
     "async_save writes the optimizer state in the background, but swap_optimizer"),
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


def _on_policy_grads(rank: int) -> dict:
    arch = load_model_arch("tiny_qwen")
    worker = ActorWorker(arch, ParallelConfig(1, 1), ACTOR, weights=sharding.random_full_state_dict(arch, seed=4))
    batch = _update_batch(arch.padded_vocab_size)
    del batch["old_log_probs"]
    rows = torch.arange(8)
    worker._backward(batch, rows, worker._policy_loss, True)
    without = reduced_grads(worker)
    own = dict(batch, old_log_probs=worker.compute_log_prob(batch)["log_probs"])
    worker._backward(own, rows, worker._policy_loss, True)
    errors = []
    try:
        worker.update({k: v.repeat(2, 1) for k, v in batch.items()})
    except ConfigError as err:
        errors.append(str(err))
    return {"without": without, "with_own": reduced_grads(worker), "errors": errors}


def test_update_without_old_log_probs_has_the_gradient_of_the_policys_own_log_probs():
    """One optimizer step per batch: the update's forward gives the old log-probs (ratio 1), so
    the separate pass can be skipped; several steps without them are refused."""
    out = run_ranks(_on_policy_grads, 1)[0]
    for name, grad in out["with_own"].items():
        assert torch.equal(out["without"][name], grad), name
    assert any(g.abs().max() > 0 for g in out["with_own"].values())
    assert out["errors"] == ["this update takes 2 optimizer steps (epochs=1, 2 mini-batches), so the batch needs "
                             "old_log_probs from a pass before the update."]
