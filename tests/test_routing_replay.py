"""Rollout routing replay (generate_config.rollout_routing_replay) on the tiny Qwen3-MoE and the tiny GLM-4.5 (its
routes cover the two MoE layers after its dense first one; sigmoid scores, expert bias, groups): the Megatron engine
records the experts every fed token went to, and the actor's passes route the same way. In fp32 the replayed
routes are the actor's own (log-probs unchanged, ≤ 1e-5 from the engine's); other routes really move the
log-probs; in bf16 replay lowers the engine-vs-actor mismatch where a route flipped."""

import pytest
import torch

from mindrl.ckpt_convert import hf_to_mcore
from mindrl.config.batching import Batching
from mindrl.launch import run_ranks
from mindrl.rollout.config import SamplingConfig
from mindrl.trainer.experience import rollout_batch
from tests.hf_models import build_hf_model, save_hf_model
from tests.test_rollout_megatron import MAX_MODEL_LEN, PROMPTS, TEMPERATURE

NEW_TOKENS = 24


def _gap(scored: dict, batch: dict, rows: slice) -> dict[str, float]:
    mask = batch["loss_mask"][rows]
    diff = ((scored["log_probs"] - batch["engine_log_probs"][rows]) * mask).abs()
    return {"max": diff.max().item(), "mean": (diff.sum() / mask.sum()).item()}


def _replay(rank: int, checkpoint: str) -> dict:
    from mindrl.rollout.megatron_engine import MegatronEngine
    from mindrl.workers.megatron_worker import ActorConfig, ActorWorker

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        from mindrl.checkpoint import megatron as mg
        from mindrl.distributed import release_model_parallel

        release_model_parallel()
        args = mg.load_args(checkpoint)
        cfg = ActorConfig(lr=1e-3, temperature=TEMPERATURE, mini_batch_size=8, micro_batch_size=2)
        actor = ActorWorker(mg.arch_of(args), mg.parallel_of(args), cfg, weights=checkpoint, params_dtype=dtype)
        engine = MegatronEngine(actor.model, actor.arch, actor.par, [], MAX_MODEL_LEN, record_routes=True)
        result = engine.generate(PROMPTS, SamplingConfig(temperature=TEMPERATURE, max_tokens=NEW_TOKENS, seed=11), n=2)
        batch = rollout_batch(PROMPTS, result, 2)
        rows = actor.local_rows(batch["tokens"].shape[0])
        plain = actor.compute_log_prob({"tokens": batch["tokens"]})
        replayed = actor.compute_log_prob({"tokens": batch["tokens"], "routes": batch["routes"]})
        entry = {"plain": _gap(plain, batch, rows), "replayed": _gap(replayed, batch, rows),
                 "route_lengths": [r.shape[0] for r in result.routes],
                 "lengths": [len(PROMPTS[i // 2]) + len(r) - 1 for i, r in enumerate(result.responses)]}
        if dtype == torch.float32:
            shuffled = batch["routes"].clone()
            shuffled[..., 0] = (shuffled[..., 0] + 1) % actor.arch.num_experts
            shuffled[..., 1] = torch.where(shuffled[..., 1] == shuffled[..., 0], (shuffled[..., 1] + 1)
                                           % actor.arch.num_experts, shuffled[..., 1])
            other = actor.compute_log_prob({"tokens": batch["tokens"], "routes": shuffled})
            entry["other"] = _gap(other, batch, rows)
            actor.batching = Batching(remove_padding=True, max_tokens=48)  # each packed token replays its own route
            packed = actor.compute_log_prob({"tokens": batch["tokens"], "routes": shuffled})
            actor.batching = Batching()
            entry["packed_other"] = ((packed["log_probs"] - other["log_probs"]) * batch["loss_mask"][rows]).abs().max()
            entry["same"] = ((plain["log_probs"] - replayed["log_probs"]) * batch["loss_mask"][rows]).abs().max().item()
            mask = batch["loss_mask"]
            update = actor.update({**batch, "advantages": torch.randn(mask.shape[0], 1).expand_as(mask) * mask,
                                   "old_log_probs": batch["engine_log_probs"]})
            entry["updated"] = update["pg_loss"] == update["pg_loss"]
        out[str(dtype)] = entry
    return out


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe"])
def replayed(tmp_path_factory, request):
    kind = request.param
    root = tmp_path_factory.mktemp("replay")
    dense_first = {"first_k_dense_replace": 1} if kind == "glm4_moe" else {}
    hf = build_hf_model(kind, seed=5, num_hidden_layers=3 if dense_first else 2, **dense_first)
    checkpoint = hf_to_mcore(save_hf_model(hf, root / "hf"), root / "mg", kind, 1, 1,
                             params_dtype=torch.float32, progress=False)
    return run_ranks(_replay, 2, str(checkpoint))


def test_the_engine_records_every_fed_tokens_route_and_fp32_replay_changes_nothing(replayed):
    for rank in replayed:
        fp32 = rank["torch.float32"]
        assert fp32["route_lengths"] == fp32["lengths"]
        assert fp32["same"] <= 1e-6  # the engine's routes are the actor's own in fp32
        assert fp32["replayed"]["max"] <= 1e-5
        assert fp32["other"]["mean"] > 1e-2  # the replayed routes decide the experts
        assert fp32["packed_other"] <= 1e-5  # and packed without padding, the same routes for the same tokens
        assert fp32["updated"]


def test_bf16_replay_lowers_the_engine_actor_mismatch(replayed):
    for rank in replayed:
        bf16 = rank["torch.bfloat16"]
        print(f"bf16 engine-vs-actor |log-prob gap| mean/max: without replay {bf16['plain']['mean']:.3e} / "
              f"{bf16['plain']['max']:.3e}, with replay {bf16['replayed']['mean']:.3e} / {bf16['replayed']['max']:.3e}")
        # where bf16 flipped no route, replay changes nothing
        flipped = bf16["plain"] != bf16["replayed"]
        assert bf16["replayed"]["mean"] < bf16["plain"]["mean"] if flipped else bf16["plain"]["mean"] > 0
