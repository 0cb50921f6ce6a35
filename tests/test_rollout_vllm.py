"""The vLLM rollout engine fed from the Megatron actor: exact log-probs after a sync, fresh weights after
every update, bucket-independent, a failed sync never generates, offload leaves training untouched."""

import dataclasses
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.rollout.config import GenerateConfig, SamplingConfig
from mindrl.trainer.experience import rollout_batch
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker
from tests.hf_models import mcore_to_hf_state

pytestmark = pytest.mark.job  # every test here starts a Ray job or a vLLM engine

pytest.importorskip("vllm")

PROMPTS = [[3, 17, 250, 9], [44, 2, 812], [5, 6, 7, 8, 9, 10], [900, 1, 77]]
MAX_TOKENS = 16
GENERATE = GenerateConfig(dtype="float32", max_model_len=64, cpu_kv_cache_mb=16, max_num_seqs=64,
                          max_num_batched_tokens=1024, check_weight_sync=True,
                          sampling_config=SamplingConfig(max_tokens=MAX_TOKENS, temperature=0.7))
GREEDY = SamplingConfig(max_tokens=MAX_TOKENS, top_k=1)


def _arch(tied: bool = True):
    arch = load_model_arch("tiny_qwen")
    return arch if tied else dataclasses.replace(arch, untie_embeddings_and_output_weights=True)


def _actor(arch, par: ParallelConfig, seed: int = 3) -> ActorWorker:
    cfg = ActorConfig(lr=1e-3, temperature=0.7, mini_batch_size=8, micro_batch_size=2)
    return ActorWorker(arch, par, cfg, weights=sharding.random_full_state_dict(arch, seed=seed, std=0.1))


def _colocated(actor: ActorWorker, cfg: GenerateConfig = GENERATE):
    from mindrl.rollout.vllm_engine import VllmEngine
    from mindrl.workers.colocated import ColocatedRollout

    return ColocatedRollout(actor, VllmEngine(actor.arch, cfg), cfg)


def _engine_vs_actor(rank: int) -> dict:
    out = {}
    for tied in (True, False):  # one engine after the other in the same ranks: closing keeps the actor's groups
        actor = _actor(_arch(tied), ParallelConfig(2, 2))
        rollout = _colocated(actor)
        result, metrics = rollout.generate(PROMPTS, n=2)
        batch = rollout_batch(PROMPTS, result, 2)
        scored = actor.compute_log_prob({"tokens": batch["tokens"]})
        rollout.engine.close()
        diff = None
        if scored is not None:
            diff = ((scored["log_probs"] - batch["engine_log_probs"]) * batch["loss_mask"]).abs().max().item()
        out[tied] = {"diff": diff, "metrics": metrics, "responses": result.responses}
    return out


@pytest.fixture(scope="module")
def engine_vs_actor() -> list[dict]:
    return run_ranks(_engine_vs_actor, 4)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_engine_log_probs_equal_the_actor_after_a_sync_from_tp2_pp2(engine_vs_actor, tied):
    ranks = [r[tied] for r in engine_vs_actor]
    diffs = [r["diff"] for r in ranks if r["diff"] is not None]
    assert len(diffs) == 2 and max(diffs) <= 1e-4, diffs  # the two TP ranks of the last stage
    assert all(r["responses"] == ranks[0]["responses"] for r in ranks)  # every rank has the whole result
    responses = ranks[0]["responses"]
    assert len(responses) == 8 and all(len(r) == MAX_TOKENS for r in responses)
    assert len({tuple(r) for r in responses}) == 8  # sampled, not one answer repeated
    metrics = ranks[0]["metrics"]
    assert metrics["sync/differing_tensors"] == 0 and metrics["sync/checked_tensors"] > 0
    assert metrics["sync/probe_max_abs_diff"] < 1e-4


def _infer_tp2(rank: int, train_tp: int) -> dict:
    """One vLLM engine spanning both ranks (infer TP=2, vLLM's external_launcher over the actor's world) fed by
    an actor at train TP=1 (two data-parallel replicas) or TP=2."""
    actor = _actor(_arch(), ParallelConfig(train_tp, 1))
    rollout = _colocated(actor, dataclasses.replace(GENERATE, infer_tensor_parallel_size=2))
    try:
        # the ranks' shared memory is named after the group alone: a name left behind (a rank killed before its
        # interpreter's exit) made the next engine of any run on the machine fail to start
        named = [name for name in os.listdir("/dev/shm") if "cpushm" in name]
        from vllm.distributed import parallel_state

        group = parallel_state.get_tp_group().device_communicator.dist_module.group_name
        result, metrics = rollout.generate(PROMPTS, n=2)
    finally:
        rollout.engine.close()
    batch = rollout_batch(PROMPTS, result, 2)
    scored = actor.compute_log_prob({"tokens": batch["tokens"]})
    rows = actor.local_rows(batch["tokens"].shape[0])
    diff = ((scored["log_probs"] - batch["engine_log_probs"][rows]) * batch["loss_mask"][rows]).abs().max().item()
    return {"diff": diff, "metrics": metrics, "responses": result.responses, "named": named, "group": group,
            "pid": os.getpid()}


@pytest.mark.parametrize("train_tp", [1, 2])
def test_an_engine_spanning_two_ranks_scores_its_samples_as_the_actor_after_a_sync(train_tp):
    ranks = run_ranks(_infer_tp2, 2, train_tp)
    assert [r["named"] for r in ranks] == [[], []]  # in use, and already unnamed
    # named for this engine (its first rank's pid and a random tag), agreed by its ranks: two runs' engines starting
    # at the same moment on one machine used the same names, and the second failed (errno 17)
    assert ranks[0]["group"] == ranks[1]["group"] and ranks[0]["group"].startswith(f"mindrl{ranks[0]['pid']}x")
    assert max(r["diff"] for r in ranks) <= 1e-4, [r["diff"] for r in ranks]
    assert ranks[0]["responses"] == ranks[1]["responses"] and len(ranks[0]["responses"]) == 8
    assert len({tuple(r) for r in ranks[0]["responses"]}) == 8
    assert ranks[0]["metrics"]["sync/differing_tensors"] == 0 and ranks[0]["metrics"]["sync/probe_max_abs_diff"] < 1e-4


def _hf_state(stages: dict, arch, par: ParallelConfig) -> dict[str, torch.Tensor]:
    """The actor's weights as HF tensors, by the converter's path (not the sync's)."""
    return mcore_to_hf_state(sharding.merge_state_dicts(stages, arch, par), arch)


def _three_rounds(rank: int) -> list[dict]:
    arch = _arch()
    actor = _actor(arch, ParallelConfig(1, 2))
    rollout = _colocated(actor)
    rounds = []
    for _ in range(3):
        result, _ = rollout.generate(PROMPTS, n=1, sampling=GREEDY)
        batch = rollout_batch(PROMPTS, result, 1)
        rounds.append({"responses": result.responses, "stage": {n: p.detach().clone()
                                                                for n, p in actor.model.named_parameters()}})
        advantages = torch.tensor([1.0, -1.0, 1.0, -1.0]).unsqueeze(1) * batch["loss_mask"]
        update = {"tokens": batch["tokens"].repeat(2, 1), "loss_mask": batch["loss_mask"].repeat(2, 1),
                  "advantages": advantages.repeat(2, 1)}
        update["old_log_probs"] = _on_every_stage(actor.compute_log_prob({"tokens": update["tokens"]}))
        actor.update(update)
    rollout.engine.close()
    return rounds


def _on_every_stage(scored: dict | None) -> torch.Tensor:
    """The last pipeline stage's log-probs, handed to every stage (a batch needs them on all)."""
    from megatron.core import parallel_state

    box = [None if scored is None else scored["log_probs"]]
    group = parallel_state.get_pipeline_model_parallel_group()
    dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=group)
    return box[0]


def _fresh_engine(rank: int, states: list[dict]) -> tuple[list[list[list[int]]], set[Path]]:
    from mindrl.rollout.vllm_engine import VllmEngine

    made, mkdtemp = [], tempfile.mkdtemp

    def recorded(*args, **kwargs) -> str:
        made.append(mkdtemp(*args, **kwargs))
        return made[-1]

    tempfile.mkdtemp = recorded
    try:
        engine = VllmEngine(_arch(), GENERATE)
    finally:
        tempfile.mkdtemp = mkdtemp
    ours = [Path(d) for d in made if Path(d).name.startswith("mindrl-vllm-")]
    assert ours, "the engine no longer writes its start-up config where this test looks"
    left = {d for d in ours if d.exists()}  # what a SIGKILL would leave behind
    out = []
    for state in states:
        engine.load_weights(state.items())
        engine.finish_weight_update()
        out.append(engine.generate(PROMPTS, GREEDY).responses)
    engine.close()
    return out, left


def test_every_round_generates_with_the_newest_weights():
    """update → sync → generate three times at PP=2: each round equals a fresh engine given that round's
    weights (converted independently of the sync), and the rounds differ."""
    arch, par = _arch(), ParallelConfig(1, 2)
    per_rank = run_ranks(_three_rounds, 2)
    states = [_hf_state({(0, pp): per_rank[pp][i]["stage"] for pp in range(2)}, arch, par) for i in range(3)]
    fresh, left = run_ranks(_fresh_engine, 1, states)[0]
    colocated = [per_rank[0][i]["responses"] for i in range(3)]
    assert colocated == fresh
    assert not left  # the engine's start-up files are gone once it runs, so a killed job leaves none
    assert colocated[0] != colocated[1] != colocated[2]


def _buckets_and_failure(rank: int) -> dict:
    from mindrl.rollout.vllm_engine import EngineBroken, VllmEngine
    from mindrl.rollout.weight_sync import WeightSyncError, sync_weights

    arch, par = _arch(), ParallelConfig(2, 1)
    actor = _actor(arch, par)
    engine = VllmEngine(arch, GENERATE)
    out = {"before_sync": _refused(engine, EngineBroken)}
    probe = [[(7 * i + 3) % 1024 for i in range(30)]]
    for bucket_bytes in (64 << 10, 1 << 20, 1 << 30):  # splits layers; a few buckets; the whole model
        stats = sync_weights(engine, actor.model, arch, par, torch.float32, bucket_bytes, digests=True)
        out[bucket_bytes] = {"buckets": stats.buckets, "digests": stats.digests,
                             "probe": engine.prompt_log_probs(probe),
                             "greedy": engine.generate(PROMPTS, GREEDY).responses}
    real_load = engine.load_weights
    calls = []

    def fails_on_the_second_bucket(weights):
        calls.append(1)
        if len(calls) == 2 and rank == 1:
            raise OSError("injected failure")
        real_load(weights)

    engine.load_weights = fails_on_the_second_bucket
    try:
        sync_weights(engine, actor.model, arch, par, torch.float32, 1 << 20)
    except WeightSyncError as err:
        out["error"] = str(err)
    out["after_failure"] = _refused(engine, EngineBroken)
    engine.load_weights = real_load
    sync_weights(engine, actor.model, arch, par, torch.float32, 1 << 20)
    out["repaired"] = engine.generate(PROMPTS, GREEDY).responses
    engine.close()
    return out


def _refused(engine, error) -> bool:
    try:
        engine.generate(PROMPTS, GREEDY)
    except error:
        return True
    return False


def test_bucket_sizes_give_identical_weights_and_a_failed_sync_never_generates():
    for rank, out in enumerate(run_ranks(_buckets_and_failure, 2)):
        small, medium, whole = out[64 << 10], out[1 << 20], out[1 << 30]
        assert small["buckets"] > medium["buckets"] > whole["buckets"] == 1
        assert small["digests"] == medium["digests"] == whole["digests"]
        assert small["probe"] == medium["probe"] == whole["probe"]  # bit-identical log-probs
        assert small["greedy"] == medium["greedy"] == whole["greedy"]
        assert out["before_sync"]  # dummy weights are never used
        side = "injected failure" if rank == 1 else "on another rank"
        assert out["error"].startswith("weight sync failed at bucket 2") and side in out["error"]
        assert out["after_failure"]
        assert out["repaired"] == whole["greedy"]


def _offload_round_trip(rank: int) -> dict:
    arch, par = _arch(), ParallelConfig(1, 1)
    actor = _actor(arch, par)
    cfg = dataclasses.replace(GENERATE, offload_train_param=True, offload_train_grad=True,
                              offload_train_optimizer=True, check_weight_sync=False)
    rollout = _colocated(actor, cfg)
    first, _ = rollout.generate(PROMPTS, n=2)
    batch = rollout_batch(PROMPTS, first, 2)
    actor.update({"tokens": batch["tokens"], "loss_mask": batch["loss_mask"],
                  "old_log_probs": batch["engine_log_probs"], "advantages": batch["loss_mask"] * 0.5})
    before = [t.detach().clone() for t in actor._optimizer_tensors()]
    params = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    _, metrics = rollout.generate(PROMPTS, n=2)
    after = actor._optimizer_tensors()
    rollout.engine.close()
    same = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return {"optimizer_same": same,
            "params_same": all(torch.equal(params[n], p) for n, p in actor.model.named_parameters()),
            "optimizer_tensors": len(before), "synced": "sync/seconds" in metrics}


def test_colocated_offload_generate_onload_leaves_training_state_bit_identical():
    for out in run_ranks(_offload_round_trip, 2):  # DP=2: the distributed optimizer's shards too
        assert out["optimizer_tensors"] > 0 and out["optimizer_same"] and out["params_same"]
        assert out["synced"]  # the update made the engine stale, so this rollout synced first


def _seeded_prefill_over_the_budget(rank: int) -> dict:
    from mindrl.rollout.vllm_engine import VllmEngine

    arch = _arch()
    state = _hf_state({(0, 0): sharding.random_full_state_dict(arch, seed=3, std=0.1)}, arch, ParallelConfig(1, 1))
    out = {}
    try:
        VllmEngine(arch, dataclasses.replace(GENERATE, max_num_batched_tokens=32, max_num_seqs=32))
    except ConfigError as err:
        out["error"] = str(err)
    engine = VllmEngine(arch, dataclasses.replace(GENERATE, max_num_batched_tokens=64))
    engine.load_weights(state.items())
    engine.finish_weight_update()
    prompts = [[(11 * i + 7 * t) % 1000 + 3 for t in range(30)] for i in range(12)]  # 360 prefill tokens
    sampling = SamplingConfig(max_tokens=8, temperature=1.0, seed=5)
    out["batch"] = engine.generate(prompts, sampling, n=2).responses
    out["alone"] = [r for i, p in enumerate(prompts)
                    for r in engine.generate([p], dataclasses.replace(sampling, seed=5 + 2 * i), n=2).responses]
    engine.close()
    return out


def test_seeded_prompts_beyond_the_token_budget_sample_as_they_would_alone():
    """vLLM-CPU crashed when a seeded request's prefill was split over steps; on CPU the engine
    schedules whole prompts, and a batch over the budget samples what each prompt does alone."""
    out = run_ranks(_seeded_prefill_over_the_budget, 1)[0]
    assert out["batch"] == out["alone"]
    assert out["error"] == ("on cpu vLLM cannot split a seeded prompt's prefill over steps, so generate_config."
                            "max_num_batched_tokens=32 must be at least max_model_len=64; raise it.")


def moe_engine_vs_actor(rank: int, generate: GenerateConfig = GENERATE) -> dict:
    arch = load_model_arch("tiny_qwen3_moe")
    actor = _actor(arch, ParallelConfig(1, 1, expert_model_parallel_size=2))
    rollout = _colocated(actor, generate)
    result, metrics = rollout.generate(PROMPTS, n=2)
    batch = rollout_batch(PROMPTS, result, 2)
    scored = actor.compute_log_prob({"tokens": batch["tokens"]})
    rollout.engine.close()
    rows = actor.local_rows(batch["tokens"].shape[0])  # data-parallel: each rank scores its own rows
    mask = batch["loss_mask"][rows]
    diff = ((scored["log_probs"] - batch["engine_log_probs"][rows]) * mask).abs()
    return {"max": diff.max().item(), "mean": (diff.sum() / mask.sum()).item(), "metrics": metrics,
            "ep": actor.ep_rank}


def test_an_expert_parallel_moe_actor_syncs_into_vllm_and_its_samples_score_the_same():
    """vLLM-CPU runs the Qwen3-MoE model from the EP=2 actor's weights (each rank's engine gets every expert);
    its log-probs of its own samples are the actor's (fp32)."""
    ranks = run_ranks(moe_engine_vs_actor, 2)
    assert sorted(r["ep"] for r in ranks) == [0, 1]
    for r in ranks:
        print(f"moe engine vs actor: max {r['max']:.2e} mean {r['mean']:.2e}")
        assert r["metrics"]["sync/differing_tensors"] == 0 and r["metrics"]["sync/checked_tensors"] > 0
        assert r["max"] <= 1e-4


#: RoPE scalings in effect past the 8th and 16th position (the samples reach about 22); YaRN's reach, 16 × 4, is the
#: engine's max_model_len
ROPE_SCALED = {"llama3": dict(rope_scaling_type="llama3", rope_scaling_factor=8.0,
                              rope_scaling_original_max_position_embeddings=8),
               "yarn": dict(rope_scaling_type="yarn", rope_scaling_factor=4.0,
                            rope_scaling_original_max_position_embeddings=16)}


def _rope_scaled_engines(rank: int) -> dict:
    out = {}
    for name, scaling in ROPE_SCALED.items():  # one engine after the other in the same ranks
        actor = _actor(dataclasses.replace(_arch(), **scaling), ParallelConfig(1, 1))
        rollout = _colocated(actor)
        try:
            result, metrics = rollout.generate(PROMPTS, n=2)
        finally:
            rollout.engine.close()
        batch = rollout_batch(PROMPTS, result, 2)
        scored = actor.compute_log_prob({"tokens": batch["tokens"]})
        diff = ((scored["log_probs"] - batch["engine_log_probs"]) * batch["loss_mask"]).abs().max().item()
        out[name] = {"diff": diff, "probe": metrics["sync/probe_max_abs_diff"]}
    return out


def test_rope_scaled_models_score_in_vllm_as_in_the_actor():
    """vLLM computes the scaling from the config.json mindrl writes for the engine; its samples score as the actor's
    beyond the original context (checked against HF in tests/test_rope_scaling.py). A YaRN engine longer than the
    scaling's reach is refused before it starts."""
    out = run_ranks(_rope_scaled_engines, 1)[0]
    for name, result in out.items():
        assert result["diff"] <= 1e-4 and result["probe"] < 1e-4, (name, result)
    from mindrl.rollout.vllm_engine import VllmEngine

    too_long = dataclasses.replace(_arch(), **ROPE_SCALED["yarn"])
    too_long = dataclasses.replace(too_long, rope_scaling_original_max_position_embeddings=8)
    with pytest.raises(ConfigError, match=r"max_model_len=64 runs past the 32 positions"):
        VllmEngine(too_long, GENERATE)
