"""An expert-parallel actor (tiny Qwen3-MoE, EP=2 over two ranks): a training checkpoint resumes
bit-identically (weights, Adam state of the layers around the experts and of each rank's experts,
metrics, RNG), is written in Megatron-LM's expert-parallel folders, and converts to the HF weights
the actor held."""

import dataclasses
from pathlib import Path

import pytest
import torch

from mindrl.checkpoint import training
from mindrl.ckpt_convert import mcore_to_hf
from mindrl.config import ParallelConfig, load_model_arch
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.workers.megatron_worker import ActorWorker
from tests.hf_models import mcore_to_hf_state
from tests.test_convert import read_hf
from tests.test_training_checkpoint import AFTER, BEFORE, CFG, EXTRA, _batch, _draws, _equal_states, _go_on, _snapshot

EP2 = ParallelConfig(1, 1, expert_model_parallel_size=2)


def _save_then_resume(rank: int, root: str) -> dict:
    arch = load_model_arch("tiny_qwen3_moe")
    full = sharding.random_full_state_dict(arch, seed=4)
    actor = ActorWorker(arch, EP2, CFG, weights=full)
    metrics = [actor.update(_batch(arch.padded_vocab_size, step)) for step in range(BEFORE)]
    _draws()
    actor.save_checkpoint(root, BEFORE, extra=EXTRA)
    out = {"ep": actor.ep_rank, "metrics": metrics, "at_save": _snapshot(actor),
           "after": _go_on(actor, arch.padded_vocab_size)}
    release_model_parallel()
    resumed = ActorWorker(arch, EP2, CFG, weights=full)
    out["resumed"] = resumed.load_checkpoint(root)
    out["at_load"] = _snapshot(resumed)
    out["resumed_after"] = _go_on(resumed, arch.padded_vocab_size)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_training") / "ckpt"
    return root, run_ranks(_save_then_resume, 2, str(root))


def test_an_expert_parallel_actor_resumes_bit_identically(runs):
    _, ranks = runs
    assert sorted(r["ep"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["resumed"] == training.Resumed(BEFORE, EXTRA, updates=BEFORE)
        assert all(m["pg_loss"] == m["pg_loss"] for m in r["metrics"])  # the updates ran
        assert _equal_states(r["at_load"]["params"], r["at_save"]["params"])
        assert _equal_states(r["resumed_after"]["params"], r["after"]["params"])
        assert r["resumed_after"]["metrics"] == r["after"]["metrics"]
        for gen in ("python", "numpy", "torch", "tracker"):
            a, b = r["resumed_after"]["draws"][gen], r["after"]["draws"][gen]
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, gen
        assert r["at_load"]["optim"].keys() == r["at_save"]["optim"].keys()
        assert any(".local_experts." in key[0] for key in r["after"]["optim"])  # the experts' Adam state too
        for key in r["after"]["optim"]:
            assert _equal_states(r["resumed_after"]["optim"][key], r["after"]["optim"][key]), key
        assert not _equal_states(r["after"]["params"], r["at_save"]["params"])
    experts = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert not torch.equal(ranks[0]["at_save"]["params"][experts], ranks[1]["at_save"]["params"][experts])
    assert len(ranks[0]["after"]["metrics"]) == AFTER


def test_the_update_reports_expert_load_and_the_load_balancing_loss(runs):
    _, ranks = runs
    arch = load_model_arch("tiny_qwen3_moe")
    for metrics in ranks[0]["metrics"] + ranks[0]["after"]["metrics"]:
        per_layer = [metrics[f"moe/load_max_over_mean_layer{i:02d}"] for i in range(arch.num_layers)]
        # every expert's tokens over the mean: 1 when balanced, num_experts / top-k when 2 experts take all
        assert all(1.0 <= r <= arch.num_experts / arch.moe_router_topk for r in per_layer), per_layer
        assert metrics["moe/load_max_over_mean"] >= max(per_layer) - 1e-6  # a step's maximum, averaged over steps
        assert metrics["moe/load_balancing_loss"] > 0
    assert ranks[0]["metrics"] == ranks[1]["metrics"]  # the same global values on every rank


def test_the_checkpoint_has_megatron_lms_expert_folders_and_converts_to_the_actors_weights(runs, tmp_path):
    root, ranks = runs
    folders = sorted(p.name for p in (Path(root) / "iter_0000002").iterdir())
    assert folders == ["mp_rank_00_000", "mp_rank_00_001"]
    for folder in folders:
        assert (Path(root) / "iter_0000002" / folder / "distrib_optim.pt").is_file()
    arch = load_model_arch("tiny_qwen3_moe")
    stages = {(0, 0, r["ep"]): r["at_save"]["params"] for r in ranks}
    expected = mcore_to_hf_state(sharding.merge_state_dicts(stages, arch, EP2), arch)
    back = read_hf(mcore_to_hf(root, tmp_path / "hf", progress=False))
    assert back.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


def _log_probs_at(rank: int, layouts: list[ParallelConfig]) -> list:
    arch = load_model_arch("tiny_qwen3_moe")
    full = sharding.random_full_state_dict(arch, seed=4, std=0.1)
    batch = _batch(arch.padded_vocab_size, 0)
    batch = {key: value[:, :15] for key, value in batch.items()}  # an odd width: TP=2 pads it for its shards
    out = []
    for par in layouts:
        release_model_parallel()
        actor = ActorWorker(arch, par, dataclasses.replace(CFG, micro_batch_size=1), weights=full)
        scored = actor.compute_log_prob({"tokens": batch["tokens"]})
        metrics = actor.update(batch)
        out.append({"rows": actor.local_rows(batch["tokens"].shape[0]), "log_probs": scored and scored["log_probs"],
                    "pg_loss": metrics["pg_loss"]})
    return out


def test_tensor_parallel_experts_pad_odd_sequences_for_their_shards_and_score_as_ep1():
    """EP=2 x TP=2 (sequence-parallel, as megatron-core requires of MoE under TP) on a 15-token batch: the rows are
    padded to a multiple of TP for the pass and cut back; log-probs and the update's loss equal EP=1 x TP=1's."""
    layouts = [ParallelConfig(1, 1), ParallelConfig(2, 1, expert_model_parallel_size=2)]
    ranks = run_ranks(_log_probs_at, 4, layouts)
    for index in range(2):
        shares = {r[index]["rows"].start: r[index]["log_probs"] for r in ranks}
        joined = torch.cat([shares[start] for start in sorted(shares)])
        assert joined.shape == (8, 15)
        if index == 0:
            reference = joined
        else:
            assert (joined - reference).abs().max().item() <= 1e-5
    assert ranks[0][1]["pg_loss"] == pytest.approx(ranks[0][0]["pg_loss"], abs=1e-5)
