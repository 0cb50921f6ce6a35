"""Rollout engines on ranks of their own, fed by push from the actor (TP=2) over a group spanning both roles: after
a push the engine scores as the actor does, after an update and a second push as the new actor does (the push takes
effect), without one the check sees the stale engine; each generate reports the version pushed; and a response
continued from its first tokens with the tokens it had left is the tail of the one-shot response."""

import dataclasses

import pytest
import torch

from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.rollout.config import GenerateConfig, SamplingConfig

pytestmark = pytest.mark.job  # a Ray cluster, two actor ranks and a vLLM engine

PROMPTS = [[3, 17, 250, 9], [44, 2, 812], [5, 6, 7, 8, 9, 10], [900, 1, 77]]
MAX_TOKENS, PREFIX = 12, 5
GENERATE = GenerateConfig(dtype="float32", max_model_len=64, cpu_kv_cache_mb=16, max_num_seqs=64,
                          max_num_batched_tokens=1024, check_weight_sync=True, weight_sync_bucket_mb=1,
                          sampling_config=SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0, seed=7))
GREEDY = SamplingConfig(max_tokens=MAX_TOKENS, top_k=1)


def _policy_spec():
    from mindrl.workers.megatron_worker import ActorConfig
    from mindrl.workers.ray_ranks import PolicySpec

    return PolicySpec(arch=load_model_arch("tiny_qwen"), par=ParallelConfig(2, 1),
                      actor=ActorConfig(lr=1e-2, temperature=1.0, mini_batch_size=8, micro_batch_size=4),
                      generate=GENERATE, bf16=False, eos_token_ids=(), initial_weights=None, with_reference=False,
                      ref_micro_batch_size=4, actor_micro_batch_size=4, rollout_elsewhere=True)


def _first_engine(probe: tuple) -> tuple:
    """(the actor's, the only rollout rank's engine's) probe log-probs."""
    actor, (engine,) = probe
    return actor, engine


def _scenario(actor, role) -> dict:
    """Everything the tests look at, in one pass over one pair of groups."""
    from mindrl.rollout.weight_sync import WeightSyncError
    from mindrl.trainer.experience import rollout_batch

    out = {"push": role.push(1)}
    out["old"] = _first_engine(role.probe())
    out["check"] = role.check()
    result, out["sampled_metrics"] = role.wait(role.generate_async(PROMPTS, 2, GENERATE.sampling_config))
    out["whole"] = role.wait(role.generate_async(PROMPTS, 1, GREEDY))[0]
    partial = [prompt + response[:PREFIX] for prompt, response in zip(PROMPTS, out["whole"].responses, strict=True)]
    out["continued"] = role.wait(role.generate_async(partial, 1, GREEDY, None, [MAX_TOKENS - PREFIX] * len(PROMPTS)))[0]
    batch = rollout_batch(PROMPTS, result, 2)
    signs = torch.tensor([1.0, -1.0] * 4).unsqueeze(1)
    actor.call("update", {**batch, "advantages": signs * batch["loss_mask"]})
    out["stale"] = _first_engine(role.probe())
    with pytest.raises(WeightSyncError) as refused:
        role.check()
    out["refused"] = str(refused.value)
    out["second_push"] = role.push(2)
    out["new"] = _first_engine(role.probe())
    out["second_check"] = role.check()
    out["after_second"] = role.wait(role.generate_async(PROMPTS[:2], 1, GREEDY))[1]
    return out


@pytest.fixture(scope="module")
def pushed() -> dict:
    import ray

    from mindrl.config.resources import RoleResource
    from mindrl.trainer.rollout_role import RolloutRole
    from mindrl.workers.group import WorkerGroup
    from mindrl.workers.ray_ranks import PolicyRank
    from mindrl.workers.rollout_rank import RolloutSpec

    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    actor = role = None
    try:
        actor = WorkerGroup("actor", PolicyRank, RoleResource("CPU", 2))
        host, port = actor.rendezvous(120)
        spec = _policy_spec()
        setup = actor.call("setup", host, port, spec, 300)[0]
        rollout = RolloutSpec(spec.arch, dataclasses.replace(GENERATE, dtype=setup["engine_dtype"]), (), seed=0)
        role = RolloutRole(actor, setup["dp_size"], rollout, RoleResource("CPU", 1), timeout_s=120)
        yield _scenario(actor, role)
    finally:
        for group in (role, actor):
            if group is not None:
                group.kill()
        ray.shutdown()


def test_a_pushed_engine_scores_as_the_actor(pushed):
    actor, engine = pushed["old"]
    assert (actor - engine).abs().max() <= 1e-4
    assert pushed["check"]["sync/probe_max_abs_diff"] <= 1e-4
    assert pushed["push"]["sync/buckets"] > 1 and pushed["push"]["sync/gigabytes"] > 0  # 1 MB buckets


def test_after_an_update_the_second_push_brings_the_new_weights(pushed):
    """The regression a push that silently did not take effect would be: the engine must score as the updated
    actor, and no longer as the old one."""
    (old, _), (new_actor, new_engine) = pushed["old"], pushed["new"]
    assert (new_actor - new_engine).abs().max() <= 1e-4
    assert (new_engine - old).abs().max() > 1e-3
    assert pushed["second_check"]["sync/probe_max_abs_diff"] <= 1e-4


def test_without_a_push_the_check_sees_the_stale_engine(pushed):
    actor, engine = pushed["stale"]
    assert (actor - engine).abs().max() > 1e-3
    assert "weight sync check failed" in pushed["refused"]


def test_each_generate_reports_the_version_pushed_before_it(pushed):
    assert pushed["sampled_metrics"]["rollout/weight_version"] == 1.0
    assert pushed["after_second"]["rollout/weight_version"] == 2.0
    assert pushed["push"]["rollout/weight_version"] == 1.0


def test_a_response_continued_with_the_tokens_it_had_left_is_the_tail_of_the_whole(pushed):
    whole, continued = pushed["whole"], pushed["continued"]
    assert all(len(r) == MAX_TOKENS for r in whole.responses)
    assert continued.responses == [r[PREFIX:] for r in whole.responses]
    gap = max(abs(a - b) for full, part in zip(whole.log_probs, continued.log_probs, strict=True)
              for a, b in zip(full[PREFIX:], part, strict=True))
    assert gap <= 1e-4


def test_the_megatron_engine_cannot_run_on_rollout_ranks_of_its_own():
    from mindrl.workers.rollout_rank import check_own_ranks

    with pytest.raises(ConfigError, match="generates with the actor's own model"):
        check_own_ranks(dataclasses.replace(GENERATE, backend="megatron"))
