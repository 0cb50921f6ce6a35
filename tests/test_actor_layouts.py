"""The actor's gradients, grad norm and metrics are the same under every layout and micro-batching,
for every loss aggregation mode; colocated roles share one layout and leave each other alone.

Gradients are compared, not weights after an Adam step (≈ lr·sign(g), blind to the gradient's scale).
"""

import dataclasses

import pytest
import torch

from mindrl.algorithms.policy_loss import LossConfig
from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker, MegatronWorker
from tests.grads import reduced_grads

ROWS, SEQ, NORM_LENGTH = 8, 16, 12
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
BASE = ActorConfig(lr=1e-4, mini_batch_size=ROWS, micro_batch_size=2, clip_grad=1e9,
                   loss=LossConfig(clip_ratio=0.2, use_kl_loss=True, kl_coef=0.1, entropy_coeff=0.01,
                                   loss_norm_length=NORM_LENGTH))


def update_batch(vocab: int, seed: int = 3) -> dict:
    """Responses of different lengths (so the aggregation modes differ), right-padded."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (ROWS, SEQ), generator=gen)
    loss_mask = torch.zeros(ROWS, SEQ)
    for r in range(ROWS):
        loss_mask[r, 5:SEQ - 1 - (r * 3) % 9] = 1
    return {"tokens": tokens, "loss_mask": loss_mask,
            "old_log_probs": torch.full((ROWS, SEQ), -6.9) + 0.3 * torch.randn(ROWS, SEQ, generator=gen),
            "ref_log_probs": torch.full((ROWS, SEQ), -6.95),
            "advantages": torch.randn(ROWS, 1, generator=gen).expand(ROWS, SEQ) * loss_mask}


def _layouts(rank: int, layouts: list[tuple[ParallelConfig, int]]) -> list[dict]:
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=4)
    batch = update_batch(arch.padded_vocab_size)
    out = []
    for par, micro in layouts:
        release_model_parallel()  # a deliberate switch of layout
        per_mode = {}
        for mode in MODES:  # same layout: each new worker joins the groups
            cfg = dataclasses.replace(BASE, micro_batch_size=micro,
                                      loss=dataclasses.replace(BASE.loss, loss_agg_mode=mode))
            worker = ActorWorker(arch, par, cfg, weights=full)
            metrics = worker.update(batch)
            per_mode[mode] = {"metrics": metrics, "grads": reduced_grads(worker)}
        out.append({"tp": worker.tp_rank, "pp": worker.pp_rank, "dp": worker.dp_rank, "modes": per_mode})
    return out


LAYOUTS = {  # world size → (layout, micro-batch size) run on it
    1: [(ParallelConfig(1, 1), ROWS), (ParallelConfig(1, 1), 2)],  # 1 and 4 micro-batches
    2: [(ParallelConfig(2, 1), 2), (ParallelConfig(1, 2), 2), (ParallelConfig(1, 1), 2),  # TP=2, PP=2, DP=2
        (ParallelConfig(2, 1, sequence_parallel=True), 2)],
    4: [(ParallelConfig(1, 1), 2), (ParallelConfig(2, 2), 1)],  # DP=4; TP=2×PP=2 with 8 micro-batches
}


@pytest.fixture(scope="module")
def by_layout() -> dict[str, dict]:
    arch = load_model_arch("tiny_qwen")
    joined = {}
    for world, layouts in LAYOUTS.items():
        per_rank = run_ranks(_layouts, world, layouts)
        for i, (par, micro) in enumerate(layouts):
            name = f"TP={par.tp}{' SP' if par.sequence_parallel else ''} PP={par.pp} DP={world // (par.tp * par.pp)} " \
                   f"micro={micro}"
            ranks = [r[i] for r in per_rank]
            joined[name] = {}
            for mode in MODES:
                stages = {(r["tp"], r["pp"]): r["modes"][mode]["grads"] for r in ranks if r["dp"] == 0}
                joined[name][mode] = {"grads": sharding.merge_state_dicts(stages, arch, par),
                                      "metrics": [r["modes"][mode]["metrics"] for r in ranks]}
    return joined


@pytest.mark.parametrize("mode", MODES)
def test_gradients_grad_norm_and_metrics_equal_across_layouts(by_layout, mode):
    reference_name = "TP=1 PP=1 DP=1 micro=8"
    reference = by_layout[reference_name][mode]
    ref_metrics = reference["metrics"][0]
    assert max(g.abs().max().item() for g in reference["grads"].values()) > 1e-3  # real gradients
    assert {"pg_loss", "kl_loss", "entropy", "clip_fraction", "approx_kl_old", "grad_norm", "lr"} <= set(ref_metrics)
    assert 0 < ref_metrics["clip_fraction"] < 1
    for name, result in by_layout.items():
        for key, ref in reference["grads"].items():
            diff = (result[mode]["grads"][key] - ref).abs().max().item()
            assert diff < 1e-6, f"{mode}: gradient of {key} at {name} differs by {diff:.2e}"
        # The norm of the full gradient, computed here from the merged tensors, is the oracle.
        norm = torch.sqrt(sum(g.double().square().sum() for g in result[mode]["grads"].values())).item()
        for metrics in result[mode]["metrics"]:  # every rank reports the global values
            assert metrics.keys() == ref_metrics.keys(), name
            assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5), f"{mode}: grad_norm at {name}"
            for key, value in ref_metrics.items():
                tolerance = 1e-5 if key == "grad_norm" else 1e-6  # a sum of ~10⁵ fp32 squares
                assert metrics[key] == pytest.approx(value, rel=tolerance, abs=1e-7), f"{mode}: {key} at {name}"


def test_aggregation_modes_give_different_gradients(by_layout):
    """Guards the test above against a batch on which all modes coincide."""
    grads = by_layout["TP=1 PP=1 DP=1 micro=8"]
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    for a in MODES:
        for b in MODES:
            if a < b:
                assert not torch.allclose(grads[a]["grads"][name], grads[b]["grads"][name], rtol=1e-3), (a, b)


def _colocated(rank: int, with_reference: bool) -> dict:
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=4)
    par = ParallelConfig(2, 1)
    actor = ActorWorker(arch, par, BASE, weights=full)
    batch = update_batch(arch.padded_vocab_size)
    ref_log_probs = None
    if with_reference:
        reference = MegatronWorker(arch, par, weights=sharding.random_full_state_dict(arch, seed=8))
        ref_log_probs = reference.compute_log_prob(batch)["log_probs"]
    metrics = actor.update(batch)
    return {"metrics": metrics, "grads": reduced_grads(actor), "ref_log_probs": ref_log_probs,
            "actor_log_probs": actor.compute_log_prob(batch)["log_probs"]}


def test_a_colocated_reference_leaves_the_actor_update_unchanged():
    alone = run_ranks(_colocated, 4, False)
    beside = run_ranks(_colocated, 4, True)
    for a, b in zip(alone, beside, strict=True):
        assert a["metrics"] == b["metrics"]
        assert all(torch.equal(a["grads"][k], b["grads"][k]) for k in a["grads"])
        assert torch.equal(a["actor_log_probs"], b["actor_log_probs"])
        assert not torch.allclose(b["ref_log_probs"], b["actor_log_probs"])  # the reference has its own weights


def _other_layout_beside(rank: int) -> str:
    arch = load_model_arch("tiny_qwen")
    ActorWorker(arch, ParallelConfig(2, 1), BASE)
    try:
        MegatronWorker(arch, ParallelConfig(1, 1))
    except ConfigError as err:
        return str(err)
    return "accepted"


def test_a_colocated_role_with_another_layout_is_refused():
    """Megatron's collectives read one global layout: a TP=1 reference built beside a TP=2 actor
    would make the actor's loss and gradients silently wrong."""
    for message in run_ranks(_other_layout_beside, 2):
        assert message.startswith("this process already hosts a model at TP=2 PP=1 EP=1 CP=1; a role colocated "
                                  "with it must use the same tensor, pipeline, expert and context parallel "
                                  "sizes"), message
