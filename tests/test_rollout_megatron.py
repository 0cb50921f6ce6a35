"""The Megatron-native rollout engine: greedy output vs HF generate, log-probs vs the actor, sampling, stops."""

import math
from dataclasses import replace

import pytest
import torch

from mindrl.ckpt_convert import hf_to_mcore
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.rollout.config import SamplingConfig
from mindrl.rollout.megatron_sampling import processed_logits, sample
from mindrl.trainer.experience import rollout_batch

TEMPERATURE = 0.7
MAX_MODEL_LEN = 64
NEW_TOKENS = 16
ROPE_SCALED = {"llama3_scaled": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8},
               "qwen2_yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}}
# Different lengths, one of a single token; the last leaves room for only 4 new tokens.
PROMPTS = [[5, 17, 99, 3, 42, 7, 8], [11, 2], [200, 150, 100, 50, 25, 1, 2, 3, 4, 5, 6], [33]]
LONG_PROMPT = [(7 * i) % 250 for i in range(MAX_MODEL_LEN - 4)]


def _hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                                       max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            out.append(generated[0, len(prompt):].tolist())
    return out


def _hf_greedy_forward(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens from HF's whole-sequence forward, one token at a time: generate's min_new_tokens forbids the
    config's eos token (Llama's default id 2), which the scaled Llama's greedy path reaches, while the engine here
    is told no eos and takes it."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt):])
    return out


def _engine(worker, eos: list[int]):
    from mindrl.rollout.megatron_engine import MegatronEngine

    return MegatronEngine(worker.model, worker.arch, worker.par, eos, max_model_len=MAX_MODEL_LEN)


def _actor(checkpoint: str, sequence_parallel: bool | None = None):
    from mindrl.checkpoint import megatron as mg
    from mindrl.workers.megatron_worker import ActorConfig, ActorWorker

    args = mg.load_args(checkpoint)
    cfg = ActorConfig(lr=1e-3, temperature=TEMPERATURE, mini_batch_size=8, micro_batch_size=2)
    par = replace(mg.parallel_of(args), sequence_parallel=sequence_parallel)
    return ActorWorker(mg.arch_of(args), par, cfg, weights=checkpoint)


def _rollouts(rank: int, checkpoint: str, others: dict[str, str], state_checks: bool,
              sequence_parallel: bool = False) -> dict:
    """Greedy and sampled rollouts of one layout and the actor's log-probs of the sampled ones; the greedy
    rollouts of `others` (name: checkpoint) in the same layout; optionally the seed / state / input checks."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    actor = _actor(checkpoint, sequence_parallel)
    engine = _engine(actor, eos=[])
    greedy = SamplingConfig(top_k=1, max_tokens=NEW_TOKENS)
    out = {"greedy": engine.generate(PROMPTS, greedy, n=2),
           "capped": engine.generate([LONG_PROMPT], greedy)}
    # eos: tokens greedy decoding reaches a few steps in, so sampled rows stop at different steps.
    eos = sorted({response[3] for response in out["greedy"].responses})
    sampled = _engine(actor, eos).generate(PROMPTS, SamplingConfig(temperature=TEMPERATURE, max_tokens=NEW_TOKENS,
                                                                   seed=11), n=2)
    scored = actor.compute_log_prob(rollout_batch(PROMPTS, sampled, n=2))
    out.update(eos=eos, sampled=sampled, actor_log_probs=None if scored is None else scored["log_probs"],
               actor_rows=actor.local_rows(len(sampled.responses)))
    for name, other in others.items():
        out[f"{name}_greedy"] = _engine(_actor(other, sequence_parallel), eos=[]).generate(PROMPTS, greedy)
    # the engine runs a sequence-parallel model in plain TP and hands it back as it was
    out["sequence_parallel"] = {actor.model.config.sequence_parallel} | {
        m.sequence_parallel for m in actor.model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)}
    if state_checks:
        out.update(_seeds_and_state(actor, engine, checkpoint))
    return out


def _seeds_and_state(actor, engine, checkpoint: str) -> dict:
    from mindrl.rollout.megatron_engine import MegatronEngine
    from mindrl.workers.megatron_worker import ActorWorker

    sampling = SamplingConfig(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, max_tokens=8, seed=3)
    out = {"runs": [engine.generate(PROMPTS, s, n=3) for s in (sampling, sampling, replace(sampling, seed=4))]}
    # One prompt per batch (max_num_seqs=4 < 2 × 3 rows): each sample still draws with its own seed.
    narrow = MegatronEngine(actor.model, actor.arch, actor.par, [], max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    out["one_prompt_at_a_time"] = narrow.generate(PROMPTS, sampling, n=3)
    # Generation must leave the actor's training state alone: the update after it equals the update without.
    actor.model.train()
    actor.model.decoder.layers[0].eval()
    flags = [m.training for m in actor.model.modules()]
    rng = torch.get_rng_state()
    rollout = engine.generate(PROMPTS, SamplingConfig(temperature=TEMPERATURE, max_tokens=6, seed=5), n=2)
    out["flags_kept"] = flags == [m.training for m in actor.model.modules()]
    out["rng_kept"] = torch.equal(rng, torch.get_rng_state())
    batch = rollout_batch(PROMPTS, rollout, n=2)
    batch["old_log_probs"] = batch["engine_log_probs"]  # the engine's log-probs, as the trainer may use them
    batch["advantages"] = torch.linspace(-1, 1, 8).unsqueeze(1).expand_as(batch["loss_mask"]) * batch["loss_mask"]
    fresh = ActorWorker(actor.arch, actor.par, actor.cfg, weights=checkpoint)
    initial = [p.detach().clone() for p in fresh.model.parameters()]
    updates = [worker.update(batch) for worker in (actor, fresh)]
    out["same_metrics"] = updates[0] == updates[1]
    out["same_params"] = all(torch.equal(a, b) for a, b in zip(actor.model.parameters(), fresh.model.parameters(),
                                                               strict=True))
    out["moved"] = any(not torch.equal(a, b) for a, b in zip(actor.model.parameters(), initial, strict=True))
    messages = []
    for prompts, n in (([[1, 2], []], 1), ([LONG_PROMPT + [1] * 4], 1), ([[1, 300]], 1), ([[1]], 0)):
        try:
            engine.generate(prompts, SamplingConfig(), n=n)
        except ValueError as err:
            messages.append(str(err))
    out["messages"] = messages
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # Imported here, not at the top: the ranks import this module, and transformers takes seconds to load.
    from tests.hf_models import build_hf_model, save_hf_model

    folder = tmp_path_factory.mktemp("models")
    hf = {kind: build_hf_model(kind, seed=seed) for kind, seed in (("qwen2", 0), ("llama3", 7), ("qwen3", 1))}
    # RoPE scaling in effect past the 8th position
    hf.update(llama3_scaled=build_hf_model("llama3", seed=7, rope_scaling=ROPE_SCALED["llama3_scaled"]),
              qwen2_yarn=build_hf_model("qwen2", seed=0, rope_scaling=ROPE_SCALED["qwen2_yarn"]))
    saved = {kind: save_hf_model(model, folder / f"{kind}_hf") for kind, model in hf.items()}

    def convert(kind: str, tp: int, pp: int) -> str:
        return str(hf_to_mcore(saved[kind], folder / f"{kind}_tp{tp}pp{pp}", kind.split("_")[0], tp, pp,
                               params_dtype=torch.float32, progress=False))

    checkpoints = {layout: convert("qwen2", *layout) for layout in ((1, 1), (2, 1), (1, 2))}
    checkpoints.update(llama3=convert("llama3", 2, 1), qwen3=convert("qwen3", 1, 1), qwen3_tp2=convert("qwen3", 2, 1),
                       llama3_scaled=convert("llama3_scaled", 2, 1), qwen2_yarn=convert("qwen2_yarn", 2, 1))
    return hf, checkpoints


def _in_turn(rank: int, jobs: list[tuple]) -> list[dict]:
    """`_rollouts` for each job, each in its own layout (one process group, no respawn between)."""
    results = []
    for job in jobs:
        release_model_parallel()
        results.append(_rollouts(rank, *job))
    return results


@pytest.fixture(scope="module")
def runs(models):
    """Both ranks' results at TP=1 (two data-parallel replicas; with Qwen3 and the state checks), TP=2 (with
    the untied Llama), PP=2 and sequence-parallel TP=2 (with Qwen3's QK norms), one layout after the other in one
    launch."""
    checkpoints = models[1]
    ranks = run_ranks(_in_turn, 2, [(checkpoints[(1, 1)], {"qwen3": checkpoints["qwen3"]}, True),
                                    (checkpoints[(2, 1)], {name: checkpoints[name] for name in (
                                        "llama3", "llama3_scaled", "qwen2_yarn")}, False),
                                    (checkpoints[(1, 2)], {}, False),
                                    (checkpoints[(2, 1)], {"qwen3": checkpoints["qwen3_tp2"]}, False, True)])
    return {layout: [results[i] for results in ranks]
            for i, layout in enumerate(("tp1", "tp2", "pp2", "tp2_sequence_parallel"))}


def _actor_log_probs(ranks: list[dict]) -> torch.Tensor:
    """The actor's log-probs of every sampled row, joined from the ranks holding them (the last stage of
    each data-parallel replica holds its share of the rows)."""
    shares = {rank["actor_rows"].start: rank["actor_log_probs"] for rank in ranks
              if rank["actor_log_probs"] is not None}
    return torch.cat([shares[start] for start in sorted(shares)])


def test_greedy_equals_hf_generate(models, runs):
    """Qwen2 (QKV bias, tied embeddings, GQA, a vocabulary of 251 that TP=2 pads) at TP=1, TP=2, PP=2."""
    expected = _hf_greedy(models[0]["qwen2"], PROMPTS, NEW_TOKENS)
    for layout, ranks in runs.items():
        for rank in ranks:  # every rank of the replica returns the same result
            greedy = rank["greedy"]
            assert greedy.responses == [r for r in expected for _ in range(2)], layout
            assert greedy.finish_reasons == ["length"] * 8
            assert all(lp == [0.0] * NEW_TOKENS for lp in greedy.log_probs)  # greedy: one token left, log 1


def test_untied_llama3_greedy_equals_hf_generate_at_tp2(models, runs):
    expected = _hf_greedy(models[0]["llama3"], PROMPTS, NEW_TOKENS)
    assert [rank["llama3_greedy"].responses for rank in runs["tp2"]] == [expected, expected]


@pytest.mark.parametrize("name", sorted(ROPE_SCALED))
def test_rope_scaled_greedy_equals_hf_generate_at_tp2(models, runs, name):
    """Llama-3.1's scaling and Qwen2's YaRN (its attention factor in the softmax scale), past the original context."""
    expected = _hf_greedy_forward(models[0][name], PROMPTS, NEW_TOKENS)
    assert [rank[f"{name}_greedy"].responses for rank in runs["tp2"]] == [expected, expected]


def test_qwen3_greedy_equals_hf_generate(models, runs):
    """Per-head QK norm, and a head size (32) other than hidden / heads (16); also sequence-parallel at TP=2."""
    expected = _hf_greedy(models[0]["qwen3"], PROMPTS, NEW_TOKENS)
    assert runs["tp1"][0]["qwen3_greedy"].responses == expected
    assert [rank["qwen3_greedy"].responses for rank in runs["tp2_sequence_parallel"]] == [expected, expected]


def test_a_sequence_parallel_actor_generates_in_plain_tp_and_is_handed_back_sequence_parallel(runs):
    """Its greedy and sampled rows are checked with the other layouts' above (HF's tokens, the actor's log-probs,
    which its sequence-parallel forward computes after the engine ran)."""
    assert [rank["sequence_parallel"] for rank in runs["tp2_sequence_parallel"]] == [{True}, {True}]
    assert [rank["sequence_parallel"] for rank in runs["tp2"]] == [{False}, {False}]


def test_a_response_stops_at_max_model_len(models, runs):
    expected = _hf_greedy(models[0]["qwen2"], [LONG_PROMPT], 4)
    for ranks in runs.values():
        assert ranks[0]["capped"].responses == expected
        assert ranks[0]["capped"].finish_reasons == ["length"]


def test_sampled_log_probs_equal_the_actor_and_eos_stops(runs):
    for layout, ranks in runs.items():
        sampled, eos, actor = ranks[0]["sampled"], set(ranks[0]["eos"]), _actor_log_probs(ranks)
        assert {r["sampled"].responses == sampled.responses for r in ranks} == {True}
        assert set(sampled.finish_reasons) == {"stop", "length"}, layout  # rows end at different steps
        for i, (response, log_probs, reason) in enumerate(zip(sampled.responses, sampled.log_probs,
                                                              sampled.finish_reasons, strict=True)):
            assert len(log_probs) == len(response)
            assert not eos & set(response[:-1])
            if reason == "stop":
                assert response[-1] in eos
            else:
                assert len(response) == NEW_TOKENS and response[-1] not in eos
            start = len(PROMPTS[i // 2]) - 1
            expected = actor[i, start:start + len(response)]
            assert (torch.tensor(log_probs) - expected).abs().max().item() < 1e-5, layout


def test_seeded_sampling_is_reproducible_whatever_the_batching(runs):
    first, again, other = runs["tp1"][0]["runs"]
    assert first.responses == again.responses and first.log_probs == again.log_probs
    assert first.responses != other.responses
    assert len({tuple(r) for r in first.responses}) > len(PROMPTS)  # the n samples of a prompt differ
    narrow = runs["tp1"][0]["one_prompt_at_a_time"]
    assert narrow.responses == first.responses
    assert max(abs(a - b) for x, y in zip(narrow.log_probs, first.log_probs, strict=True)
               for a, b in zip(x, y, strict=True)) < 1e-5


def test_generation_leaves_the_actor_update_unchanged(runs):
    state = runs["tp1"][0]
    assert state["flags_kept"] and state["rng_kept"]
    assert state["same_metrics"] and state["same_params"]
    assert state["moved"]  # the update did change the weights


def test_bad_requests_are_one_sentence(runs):
    assert runs["tp1"][0]["messages"] == [
        "prompt 1 is empty; every prompt needs at least one token id.",
        "prompt 0 has 64 tokens, which leaves no room for a response within max_model_len=64; shorten it or "
        "raise max_model_len.",
        "prompt 0 holds a token id outside the model's vocabulary [0, 251).",
        "n must be a positive integer, got 0.",
    ]


# Probabilities 0.5, 0.25, 0.15, 0.1 at temperature 1.
LOGITS = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()


@pytest.mark.parametrize("keys, kept", [
    (dict(), [0.5, 0.25, 0.15, 0.1]),
    (dict(top_k=3), [0.5, 0.25, 0.15]),
    (dict(top_p=0.7), [0.5, 0.25]),  # the smallest most-likely set whose mass reaches 0.7
    (dict(min_p=0.35), [0.5, 0.25]),  # below 0.35 × 0.5 goes
    (dict(min_p=0.25, top_p=0.6), [0.5, 0.25]),  # min_p first: 0.1 goes, then top_p of 0.5/0.9, 0.25/0.9, 0.15/0.9
    (dict(top_k=1), [0.5]),
])
def test_filters_keep_what_vllm_keeps_and_renormalise(keys, kept):
    log_probs = processed_logits(LOGITS, SamplingConfig(**keys)).log_softmax(-1)[0]
    expected = torch.tensor([p / sum(kept) for p in kept] + [0.0] * (4 - len(kept)))
    assert torch.allclose(log_probs.exp(), expected, atol=1e-6)


def test_draws_follow_the_processed_distribution():
    sampling = SamplingConfig(temperature=2.0, top_k=3, seed=0)
    rows = 40000
    tokens, log_probs = sample(LOGITS.expand(rows, 4), sampling, [torch.Generator().manual_seed(0)] * rows)
    weights = torch.tensor([0.5, 0.25, 0.15]) ** 0.5  # p ** (1 / T), then the top 3, renormalised
    expected = weights / weights.sum()
    frequency = torch.bincount(tokens, minlength=4).double() / rows
    assert frequency[3] == 0 and torch.allclose(frequency[:3], expected.double(), atol=0.01)
    assert torch.allclose(log_probs, expected.log()[tokens], atol=1e-6)
    assert math.isclose(sample(LOGITS, SamplingConfig(top_k=1), [])[1].item(), 0.0, abs_tol=1e-7)


@pytest.mark.gpu
def test_cuda_greedy_equals_hf_and_log_probs_equal_the_actor(models):
    result = run_ranks(_in_turn, 1, [(models[1][(1, 1)], {}, False)], device="cuda")[0][0]
    expected = _hf_greedy(models[0]["qwen2"], PROMPTS, NEW_TOKENS)
    assert result["greedy"].responses == [r for r in expected for _ in range(2)]
    sampled, actor = result["sampled"], _actor_log_probs([result])
    for i, (response, log_probs) in enumerate(zip(sampled.responses, sampled.log_probs, strict=True)):
        start = len(PROMPTS[i // 2]) - 1
        assert (torch.tensor(log_probs) - actor[i, start:start + len(response)]).abs().max().item() < 1e-5


def _colocated_megatron(rank: int, checkpoint: str) -> dict:
    """A colocated rollout with the Megatron-native engine at DP=2: each replica generates half the prompts."""
    from mindrl.rollout.config import GenerateConfig
    from mindrl.workers.colocated import ColocatedRollout

    actor = _actor(checkpoint)
    cfg = GenerateConfig(backend="megatron", max_model_len=MAX_MODEL_LEN, offload_train_grad=True,
                         offload_train_optimizer=True, offload_train_param=True,
                         sampling_config=SamplingConfig(top_k=1, max_tokens=NEW_TOKENS))
    rollout = ColocatedRollout.build(actor, cfg, eos_token_ids=[])
    engine = rollout.engine
    first, _ = rollout.generate(PROMPTS, n=2)
    batch = rollout_batch(PROMPTS, first, n=2)
    actor.update({**batch, "old_log_probs": torch.zeros_like(batch["loss_mask"]),
                  "advantages": torch.linspace(-1, 1, 8).unsqueeze(1) * batch["loss_mask"]})
    optimizer = [t.detach().clone() for t in actor._optimizer_tensors()]
    params = [p.detach().clone() for p in actor.model.parameters()]
    second, metrics = rollout.generate(PROMPTS, n=2)
    return {"engine": engine.name, "first": first.responses, "second": second.responses,
            "direct": engine.generate(PROMPTS, cfg.sampling_config, n=2).responses, "metrics": metrics,
            "optimizer_same": all(torch.equal(a, b) for a, b in zip(optimizer, actor._optimizer_tensors(),
                                                                    strict=True)),
            "params_same": all(torch.equal(a, b) for a, b in zip(params, actor.model.parameters(), strict=True))}


def test_colocated_megatron_rollout_splits_over_replicas_and_reads_the_updated_actor(models):
    first, second = run_ranks(_colocated_megatron, 2, models[1][(1, 1)])
    assert first["engine"] == "megatron" and first["first"] == second["first"] and first["second"] == second["second"]
    expected = _hf_greedy(models[0]["qwen2"], PROMPTS, NEW_TOKENS)
    assert first["first"] == [r for r in expected for _ in range(2)]  # the two replicas' halves, in prompt order
    assert first["second"] != first["first"]  # the update moved the weights; nothing had to be synced
    assert first["second"] == first["direct"]
    assert "sync/seconds" in first["metrics"] and first["metrics"]["sync/gigabytes"] == 0
    assert first["optimizer_same"] and first["params_same"]


def test_the_backend_is_vllm_where_installed_else_megatron(monkeypatch):
    from mindrl.config import ConfigError
    from mindrl.rollout import engines, vllm_engine
    from mindrl.rollout.config import GenerateConfig

    installed = vllm_engine.vllm_available()
    assert engines.resolve_backend(GenerateConfig()) == ("vllm" if installed else "megatron")
    assert engines.resolve_backend(GenerateConfig(backend="megatron")) == "megatron"
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    assert engines.resolve_backend(GenerateConfig()) == "megatron"
    with pytest.raises(ConfigError, match="backend is vllm but vLLM is not installed here"):
        engines.resolve_backend(GenerateConfig(backend="vllm"))


def _moe_rollouts(rank: int, checkpoint: str) -> dict:
    actor = _actor(checkpoint)
    greedy = _engine(actor, eos=[]).generate(PROMPTS, SamplingConfig(top_k=1, max_tokens=NEW_TOKENS))
    sampled = _engine(actor, eos=[]).generate(PROMPTS, SamplingConfig(temperature=TEMPERATURE, max_tokens=NEW_TOKENS,
                                                                      seed=3), n=2)
    batch = rollout_batch(PROMPTS, sampled, 2)
    scored = actor.compute_log_prob({"tokens": batch["tokens"]})
    rows = actor.local_rows(batch["tokens"].shape[0])
    mask = batch["loss_mask"][rows]
    diff = ((scored["log_probs"] - batch["engine_log_probs"][rows]) * mask).abs().max().item()
    return {"greedy": greedy.responses, "diff": diff}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_a_moe_model_generates_as_hf_and_scores_as_the_actor(tmp_path, kind, tp):
    """Qwen3-MoE (routed experts, renormalised top-2) and DeepSeek-V3 (multi-latent attention, whose cached values
    are narrower than its keys, over dense-first sigmoid routing) through the Megatron engine: two data-parallel
    replicas, or one at TP=2, whose sequence-parallel MoE layers decode in plain TP."""
    from tests.hf_models import build_hf_model, save_hf_model

    hf = build_hf_model(kind, seed=5, num_hidden_layers=2 if kind == "qwen3_moe" else 4)
    checkpoint = hf_to_mcore(save_hf_model(hf, tmp_path / "hf"), tmp_path / "mg", kind, tp, 1,
                             params_dtype=torch.float32, progress=False)
    expected = _hf_greedy_forward(hf, PROMPTS, NEW_TOKENS)  # DeepSeek-V3's eos (1) is a token the engine may draw
    for rank in run_ranks(_moe_rollouts, 2, str(checkpoint)):
        assert rank["greedy"] == expected
        print(f"moe megatron engine vs actor: {rank['diff']:.2e}")
        assert rank["diff"] <= 1e-5


def _ep_rollouts(rank: int, checkpoint: str) -> dict:
    """EP=2 over the two data-parallel replicas, each with other work: rank 0 decodes three prompts for
    NEW_TOKENS steps in several prefill chunks, rank 1 one prompt for fewer steps, and then nothing at all;
    their forwards must still pair up in every MoE layer's all-to-all."""
    import torch.distributed as dist

    from mindrl.rollout.base import RolloutResult
    from mindrl.rollout.megatron_engine import MegatronEngine

    actor = _actor(checkpoint)
    engine = MegatronEngine(actor.model, actor.arch, actor.par, [], max_model_len=MAX_MODEL_LEN,
                            max_num_batched_tokens=12)
    replica = actor.dp_rank
    mine = PROMPTS[:3] if replica == 0 else PROMPTS[3:]
    greedy = engine.generate(mine, SamplingConfig(top_k=1, max_tokens=NEW_TOKENS if replica == 0 else 5))
    alone = engine.generate(PROMPTS[:1] if replica == 0 else [], SamplingConfig(top_k=1, max_tokens=3))
    sampled = engine.generate(mine, SamplingConfig(temperature=TEMPERATURE, max_tokens=NEW_TOKENS, seed=3), n=2)
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, (replica, sampled))  # the actor scores the whole batch, each replica its rows
    shares = [dict(shares)[r] for r in range(2)]
    whole = RolloutResult(*([item for share in shares for item in getattr(share, key)]
                            for key in ("responses", "log_probs", "finish_reasons")))
    batch = rollout_batch(PROMPTS, whole, 2)
    scored = actor.compute_log_prob({"tokens": batch["tokens"]})
    diff = None
    if scored is not None:  # the last stage's
        rows = actor.local_rows(batch["tokens"].shape[0])
        diff = ((scored["log_probs"] - batch["engine_log_probs"][rows]) * batch["loss_mask"][rows]).abs().max().item()
    return {"greedy": greedy.responses, "alone": alone.responses, "diff": diff, "ep": actor.ep_rank}


@pytest.mark.parametrize("pp", [1, 2])
def test_expert_parallel_replicas_decode_different_work_in_lockstep(tmp_path, pp):
    """The Megatron engine at EP=2 (and EP=2 x PP=2): replicas with other prompts, lengths and step counts (one
    with none) give HF's greedy tokens and the actor's log-probs."""
    from tests.hf_models import build_hf_model, save_hf_model

    hf = build_hf_model("qwen3_moe", seed=5, num_hidden_layers=2)
    checkpoint = hf_to_mcore(save_hf_model(hf, tmp_path / "hf"), tmp_path / "mg", "qwen3_moe", 1, pp,
                             params_dtype=torch.float32, progress=False, ep=2)
    expected = _hf_greedy(hf, PROMPTS, NEW_TOKENS)
    ranks = run_ranks(_ep_rollouts, 2 * pp, str(checkpoint))
    first, second = (next(r for r in ranks if r["ep"] == ep and r["diff"] is not None) for ep in (0, 1))
    assert first["greedy"] == expected[:3] and second["greedy"] == [expected[3][:5]]
    assert first["alone"] == [expected[0][:3]] and second["alone"] == []
    for rank in (first, second):
        print(f"moe megatron engine at EP=2 vs actor: {rank['diff']:.2e}")
        assert rank["diff"] <= 1e-5
