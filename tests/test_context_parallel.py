"""Context parallelism (mindrl/models/context_parallel.py): a packed sequence cut over 2 or 4 CP ranks, joined by
all-to-all (Ulysses) or ring attention, gives the unsplit model's logits and gradients for a dense model, a
mixture of experts and multi-latent attention, and the actor's passes give one rank's log-probs, entropies,
gradients and metrics at CP2, CP4, TP2×CP2 with sequence parallelism, PP2×CP2, DP2×CP2 and EP2×CP2; samples share
prompts, some are shorter than 2 × CP chunks and most do not divide. HF transformers scores the rows as the split
model does; the ring moves CP − 1 key/value chunks per layer forward; SFT, DPO, the critic and the reward model run
split."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mindrl.config import ConfigError, ParallelConfig, load_model_arch, validate_parallel
from mindrl.config.batching import Batching
from mindrl.config.lora import LoraConfig
from mindrl.distributed import init_model_parallel, release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import context_parallel, sharding
from mindrl.models.attention import Segments
from mindrl.models.gpt import build_gpt_model, load_stage_weights
from mindrl.models.micro_batches import pack_rows
from mindrl.workers.megatron_worker import ActorWorker
from tests.grads import reduced_grads
from tests.test_actor_layouts import BASE
from tests.test_packed_micro_batches import BUDGET, PACKED, PROMPTS, RESPONSES, hf_scored_rows, long_tailed_batch
from tests.test_prompt_packing import grouped_batch

RING, ULYSSES = "megatron_cp_algo", "ulysses_cp_algo"
TOLERANCE = 1e-5


def _arch(name: str, **fields: object):
    arch = load_model_arch(name)
    if arch.is_moe:  # the routers' load-balancing loss is per rank's tokens: the model checks compare the main loss
        fields.setdefault("moe_aux_loss_coeff", 0.0)
    return dataclasses.replace(arch, **fields)


def _segments() -> Segments:
    """A prompt of 5 with two responses behind it (8 and 3 tokens), then samples of 40, 1 and 7 tokens."""
    lengths = (5, 8, 3, 40, 1, 7)
    starts = tuple(sum(lengths[:i]) for i in range(len(lengths)))
    prefixes = ((0, 0), (0, 5), (0, 5), (16, 0), (56, 0), (57, 0))
    return Segments(starts, lengths, prefixes)


@pytest.mark.parametrize("size", [2, 4])
def test_the_split_gives_every_token_to_one_rank_in_zigzag_chunks(size):
    """Rank r holds chunks r and 2·CP − 1 − r of each sample, chunk sizes differ by at most one token (a sample
    shorter than 2 × CP leaves chunks empty), every share has the same padded length, and every token is on one
    rank."""
    segments = _segments()
    layouts = [context_parallel.ContextSplit(segments, size, rank, "ring", multiple=4, width=9)
               for rank in range(size)]
    assert len({layout.length for layout in layouts}) == 1
    assert layouts[0].length % 4 == 0 and layouts[0].length >= 9
    held = torch.cat([layout.index()[layout.index() >= 0] for layout in layouts])
    assert sorted(held.tolist()) == list(range(64))
    for rank, layout in enumerate(layouts):
        index = layout.index()
        assert (index[layout.real():] == -1).all() and (index[:layout.real()] >= 0).all()
        for s, (start, length) in enumerate(zip(segments.starts, segments.lengths, strict=True)):
            chunks = torch.tensor_split(torch.arange(start, start + length), 2 * size)
            mine = torch.cat([chunks[rank], chunks[2 * size - 1 - rank]])
            pieces = [p for p in layout.pieces[rank] if p.segment == s]
            assert [p.chunk for p in pieces] == [rank, 2 * size - 1 - rank]
            assert torch.equal(torch.cat([index[p.local:p.local + p.length] for p in pieces]), mine)
    assert any(p.length == 0 for p in layouts[0].pieces[0])  # the one-token sample leaves chunks empty


@pytest.mark.parametrize("value_width", [32, 24], ids=["values as wide as keys", "narrower values"])
@pytest.mark.parametrize("diagonal", [0, 24], ids=["full", "with its diagonal"])
def test_a_ring_blocks_output_log_sum_exp_and_gradients_equal_autograds(diagonal, value_width):
    """One block of 24 queries over 40 keys (4 heads in 2 groups; values as wide as the keys, or narrower as
    multi-latent attention's), by matmuls and by torch's fused CPU kernel, against autograd through a plain masked
    softmax: a single block's merged output is its own."""
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(n, h, d, generator=gen)
                         for n, h, d in ((24, 4, 32), (40, 2, 32), (40, 2, value_width)))
    grad = torch.randn(24, 4, value_width, generator=gen)
    leaves = [x.clone().requires_grad_() for x in (query, key, value)]
    q, k, v = leaves[0].transpose(0, 1), *(x.repeat_interleave(2, dim=1).transpose(0, 1) for x in leaves[1:])
    scores = q @ k.transpose(1, 2) * 0.2
    if diagonal:
        scores = scores.masked_fill(torch.ones(24, 40, dtype=torch.bool).tril(16).logical_not(), float("-inf"))
    expected = (scores.softmax(-1) @ v).transpose(0, 1)
    expected.backward(grad)
    expected_lse = scores.logsumexp(-1).t()
    for attend, attend_grad in ((context_parallel._block, context_parallel._block_grad),
                                (context_parallel._fused_block, context_parallel._fused_block_grad)):
        out, lse = attend(query, key, value, diagonal, 0.2, 2)
        assert (out - expected).abs().max().item() <= TOLERANCE and (lse - expected_lse).abs().max() <= TOLERANCE
        if attend_grad is context_parallel._block_grad:
            grads = attend_grad(query, key, value, grad, (grad * out).sum(-1), lse, diagonal, 0.2, 2)
        else:
            grads = attend_grad(query, key, value, grad, out, lse, diagonal, 0.2, 2)
        for got, leaf in zip(grads, leaves, strict=True):
            assert (got - leaf.grad).abs().max().item() <= TOLERANCE * leaf.grad.abs().max().item()


def _gathered(values: torch.Tensor, layout: context_parallel.ContextSplit, total: int) -> torch.Tensor:
    """The whole packed sequence's [total, ...] values from every CP rank's [length, ...] share."""
    shares = [torch.empty_like(values) for _ in range(layout.size)]
    dist.all_gather(shares, values.contiguous(), group=parallel_state.get_context_parallel_group())
    out = values.new_zeros((total, *values.shape[1:]))
    for rank, share in enumerate(shares):
        index = layout.index(rank)
        out[index[index >= 0]] = share[index >= 0]
    return out


def _model_parity(rank: int, cases: list[tuple[str, int, str, dict, bool]]) -> list[dict]:
    """Each case's model on its CP ranks: logits of the split sequence against the whole sequence's (attended in one
    piece on every rank), gradients (of Σ logits · w) summed over the CP ranks against the whole's, and the sends
    each rank made in the split forward. `fused`: every ring block by torch's fused CPU kernel (else these small
    blocks take the matmuls)."""
    out = []
    threshold = context_parallel.MATERIALISE_MAX
    for algo, cp, name, fields, fused in cases:
        context_parallel.MATERIALISE_MAX = 0 if fused else threshold
        release_model_parallel()
        arch = _arch(name, **fields)
        par = ParallelConfig(1, 1, context_parallel_size=cp, context_parallel_algo=algo)
        init_model_parallel(par, seed=1, arch=arch)
        model = build_gpt_model(arch, par)
        full = sharding.random_full_state_dict(arch, seed=4)
        load_stage_weights(model, sharding.shard_state_dict(full, arch, par, 0, 0, 0))
        tokens = torch.randint(0, arch.padded_vocab_size, (6, 48), generator=torch.Generator().manual_seed(0))
        tokens[1:3, :5] = tokens[0, :5]
        lengths, prompts = torch.tensor([5 + 8, 5 + 3, 5, 40, 1, 7]), torch.tensor([5, 5, 5, 20, 1, 3])
        packed = pack_rows(tokens, lengths, prompts, [range(0, 3), range(3, 4), range(4, 5), range(5, 6)])
        whole = model(packed.tokens, packed.position_ids, packed.segments)
        weights = torch.randn(whole.shape, generator=torch.Generator().manual_seed(1))
        (whole * weights).sum().backward()
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # not the frozen expert bias
        expected = {n: p.grad.clone() for n, p in trained}
        model.zero_grad()
        share = context_parallel.share({"tokens": packed.tokens, "position_ids": packed.position_ids,
                                        "attention_mask": packed.segments, "source": packed.source}, packed.real,
                                       cp, parallel_state.get_context_parallel_rank(), par.cp_algo)
        layout = share["attention_mask"]
        sends = []
        batched = dist.batch_isend_irecv
        dist.batch_isend_irecv = lambda ops, sends=sends, batched=batched: \
            sends.extend(op for op in ops if op.op is dist.isend) or batched(ops)
        try:
            split = model(share["tokens"], share["position_ids"], layout)
        finally:
            dist.batch_isend_irecv = batched
        index = layout.index()
        local_weights = torch.where((index >= 0)[None, :, None], weights[:, index.clamp(min=0)], 0.0)
        (split * local_weights).sum().backward()
        group = parallel_state.get_context_parallel_group()
        grads = {}
        for n, p in trained:
            dist.all_reduce(p.grad, group=group)
            grads[n] = p.grad
        logits = _gathered(split[0].detach(), layout, packed.real)
        largest = max(g.abs().max().item() for g in expected.values())
        out.append({"case": (algo, cp, name, fused),
                    "logits": (logits - whole[0, :packed.real].detach()).abs().max().item(),
                    "grads": max((grads[n] - g).abs().max().item() for n, g in expected.items()) / largest,
                    "sends": len(sends), "layers": arch.num_layers, "largest": largest})
    release_model_parallel()
    return out


def test_split_logits_and_gradients_equal_the_whole_sequences():
    """≤ 1e-5 (fp32; gradients of the largest), each algorithm at CP2 and CP4 (Ulysses at CP4 on a model with 4
    key-value heads), dense, MoE and multi-latent attention (values narrower than keys), the ring's blocks by matmuls
    and by the fused CPU kernel; the ring sends CP − 1 key/value chunks per layer forward, Ulysses none."""
    two = [(RING, 2, "tiny_qwen", {}, False), (RING, 2, "tiny_qwen", {}, True), (ULYSSES, 2, "tiny_qwen", {}, False),
           (RING, 2, "tiny_qwen3_moe", {}, False), (ULYSSES, 2, "tiny_qwen3_moe", {}, False),
           (RING, 2, "tiny_deepseek_v3", {}, True), (ULYSSES, 2, "tiny_deepseek_v3", {}, False)]
    four = [(RING, 4, "tiny_qwen", {}, False), (ULYSSES, 4, "tiny_qwen", {"num_query_groups": 4}, False),
            (RING, 4, "tiny_qwen3_moe", {}, True)]
    for world, cases in ((2, two), (4, four)):
        for result in [r for rank in run_ranks(_model_parity, world, cases) for r in rank]:
            algo, cp, _, _ = result["case"]
            assert result["largest"] > 1e-2
            assert result["logits"] <= TOLERANCE, result
            assert result["grads"] <= TOLERANCE, result
            assert result["sends"] == (result["layers"] * (cp - 1) if algo == RING else 0), result


#: LoRA adapters on every linear layer of the attention and the MLP
LORA = LoraConfig(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), 4, 8.0)


def _passes(rank: int, name: str, par: ParallelConfig, batchings: dict[str, Batching], packing: str,
            lora: LoraConfig | None = None) -> dict:
    arch = load_model_arch(name)
    full = sharding.random_full_state_dict(arch, seed=4)
    batch = long_tailed_batch(arch.padded_vocab_size)
    out = {}
    for label, batching in batchings.items():
        release_model_parallel()
        cfg = dataclasses.replace(BASE, mini_batch_size=batch["tokens"].shape[0], micro_batch_size=3,
                                  batching=batching, prompt_packing=packing, lora=lora or LoraConfig())
        worker = ActorWorker(arch, par, cfg, weights=full)
        scores = worker.compute_log_prob(batch, with_entropy=True)
        metrics = worker.update(batch)
        stage = (worker.tp_rank, worker.pp_rank) + ((worker.ep_rank,) if par.ep > 1 else ())
        out[label] = {"scores": scores, "metrics": metrics, "grads": reduced_grads(worker), "stage": stage,
                      "rows": worker.rows_for(batch, worker.batching), "holds": worker.tp_rank == worker.cp_rank == 0}
    release_model_parallel()
    return out


#: model, its prompt packing, adapters
MODELS = {"dense": ("tiny_qwen", "auto", None), "moe": ("tiny_qwen3_moe", "off", None),
          "dense lora": ("tiny_qwen", "auto", LORA)}


@pytest.fixture(scope="module")
def one_rank() -> dict[str, dict]:
    """Each model's passes on one rank, packed (the reference)."""
    return {model: run_ranks(_passes, 1, name, ParallelConfig(1, 1), {"packed": PACKED}, packing, lora)[0]["packed"]
            for model, (name, packing, lora) in MODELS.items()}


def _ring(**kwargs: object) -> ParallelConfig:
    return ParallelConfig(context_parallel_size=kwargs.pop("cp", 2), context_parallel_algo=RING, **kwargs)


def _ulysses(**kwargs: object) -> ParallelConfig:
    return ParallelConfig(context_parallel_size=kwargs.pop("cp", 2), context_parallel_algo=ULYSSES, **kwargs)


LAYOUTS = {
    "cp2 ring": ("dense", _ring(), 2), "cp2 ulysses": ("dense", _ulysses(), 2),
    "cp4 ring": ("dense", _ring(cp=4), 4),
    "tp2 cp2 ring, sequence parallel": ("dense", _ring(tensor_model_parallel_size=2, sequence_parallel=True), 4),
    "pp2 cp2 ulysses": ("dense", _ulysses(pipeline_model_parallel_size=2), 4),
    "pp2 cp2 ring": ("dense", _ring(pipeline_model_parallel_size=2), 4),
    "dp2 cp2 ring": ("dense", _ring(), 4),
    "lora cp2 ring": ("dense lora", _ring(), 2),
    "moe ep2 cp2 ring": ("moe", _ring(expert_model_parallel_size=2), 4),
    "moe ep2 cp2 ulysses": ("moe", _ulysses(expert_model_parallel_size=2), 2),
    "moe tp2 cp2 ring": ("moe", _ring(tensor_model_parallel_size=2), 4),
    "moe pp2 cp2 ulysses": ("moe", _ulysses(pipeline_model_parallel_size=2), 4),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_passes_equal_one_ranks(layout, one_rank):
    """Log-probs and entropies ≤ 1e-5, gradients ≤ 1e-5 × the largest, the update's metrics, packed and cut by a
    token budget (a mixture of experts packed alone: its router losses are per micro-batch, which a budget cuts
    otherwise)."""
    model, par, world = LAYOUTS[layout]
    name, packing, lora = MODELS[model]
    moe = model == "moe"
    batchings = {"packed": PACKED} if moe else {"packed": PACKED, "budget": BUDGET}
    runs = run_ranks(_passes, world, name, par, batchings, packing, lora)
    expected = one_rank[model]
    arch = load_model_arch(name)

    def merged(stages: dict, layout: ParallelConfig) -> dict:  # LoRA's adapters: the layouts here are TP1 PP1
        return next(iter(stages.values())) if lora else sharding.merge_state_dicts(stages, arch, layout)

    whole = merged({(0, 0): expected["grads"]}, ParallelConfig(1, 1))
    mask = grouped_batch(10, prompts=PROMPTS, responses=RESPONSES)["loss_mask"].bool()
    largest = max(g.abs().max().item() for g in whole.values())
    for label in batchings:
        stages = {}
        for result in runs:
            stages.setdefault(result[label]["stage"], result[label]["grads"])
        for key, grad in merged(stages, par).items():
            diff = (grad - whole[key]).abs().max().item()
            assert diff <= TOLERANCE * largest, f"{label}: gradient of {key} differs by {diff:.2e}"
    for result in runs:
        for label, got in result.items():
            if got["scores"] is not None and got["holds"]:
                for key in ("log_probs", "entropy"):
                    diff = (got["scores"][key] - expected["scores"][key][got["rows"]])[mask[got["rows"]]]
                    assert diff.abs().max().item() <= TOLERANCE, f"{label}: {key}"
            for key, value in expected["metrics"].items():
                if key not in ("prompt_packed", "lr") and not key.startswith("moe/load_max"):
                    assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), f"{label}: {key}"


def test_ulysses_refuses_heads_that_do_not_divide_and_a_vision_language_model_is_refused():
    tiny = load_model_arch("tiny_qwen")  # 4 heads, 2 key-value groups
    with pytest.raises(ConfigError, match="num_query_groups=2; use megatron_cp_algo"):
        validate_parallel(tiny, _ulysses(cp=4))
    with pytest.raises(ConfigError, match="TP × CP = 2×2 ranks whole heads"):
        validate_parallel(tiny, _ulysses(tensor_model_parallel_size=2))
    validate_parallel(tiny, _ring(cp=4, tensor_model_parallel_size=2))
    with pytest.raises(ConfigError, match="vision-language model"):
        validate_parallel(load_model_arch("tiny_qwen25_vl"), _ring())
    with pytest.raises(ConfigError, match="context_parallel_algo must be one of"):
        ParallelConfig(context_parallel_size=2, context_parallel_algo="ring")


def _hf_scored(rank: int, checkpoint: str, batch: dict) -> list[dict]:
    from mindrl.checkpoint import megatron as mg
    from mindrl.workers.megatron_worker import MegatronWorker

    args = mg.load_args(checkpoint)
    out = []
    for algo in (RING, ULYSSES):
        release_model_parallel()
        par = dataclasses.replace(mg.parallel_of(args), context_parallel_size=2, context_parallel_algo=algo)
        worker = MegatronWorker(mg.arch_of(args), par, weights=checkpoint, temperature=0.7, batching=BUDGET)
        out.append(worker.compute_log_prob(batch, with_entropy=True))
    release_model_parallel()
    return out


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe", "deepseek_v3"])
def test_split_log_probs_equal_hf_transformers_scoring_each_row(tmp_path, kind):
    """CP2, each algorithm, rows cut by a token budget: HF's own model scoring each padded row is the oracle (for
    DeepSeek-V3, multi-latent attention under YaRN past its original context)."""
    checkpoint, batch, expected, entropy, mask = hf_scored_rows(tmp_path, kind, 1)
    for out in run_ranks(_hf_scored, 2, checkpoint, batch)[0]:
        assert (out["log_probs"][:, :-1] - expected)[mask].abs().max().item() < TOLERANCE
        assert (out["entropy"][:, :-1] - entropy)[mask].abs().max().item() < TOLERANCE


def _other_roles(rank: int, par: ParallelConfig) -> dict:
    """SFT's and DPO's gradients, the critic's values and gradients, the reward model's scores."""
    from mindrl.algorithms.dpo_loss import DPOLossConfig
    from mindrl.algorithms.value_loss import ValueLossConfig
    from mindrl.workers.critic_worker import CriticWorker, critic_arch
    from mindrl.workers.reward_worker import RewardModelWorker

    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=4)
    batch = grouped_batch(arch.padded_vocab_size, 5, (5, 9, 7, 6), ((3, 30), (2, 45), (12, 1), (7, 8)))
    rows = batch["tokens"].shape[0]
    cfg = dataclasses.replace(BASE, mini_batch_size=rows, micro_batch_size=2, batching=PACKED)
    noise = 0.3 * torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(2))
    out = {}
    for stage in ("sft", "dpo"):
        release_model_parallel()
        worker = ActorWorker(arch, par, cfg, weights=full)
        if stage == "sft":
            worker.sft_step({"tokens": batch["tokens"], "loss_mask": batch["loss_mask"]})
        else:
            worker.dpo_step({**batch, "ref_log_probs": (noise - 6.9) * batch["loss_mask"]}, DPOLossConfig())
        out[stage] = reduced_grads(worker)
    release_model_parallel()
    scored = critic_arch(arch)
    head = sharding.random_full_state_dict(scored, seed=5)
    critic = CriticWorker(arch, par, cfg, ValueLossConfig(), weights=head)
    values = critic.compute_values(batch)
    returns = noise * batch["loss_mask"]
    critic.update({**batch, "values": noise.abs() * 0.1, "returns": returns})
    out.update(values=values, critic=reduced_grads(critic))
    release_model_parallel()
    reward = RewardModelWorker(scored, par, head, torch.float32, micro_batch_size=2, batching=PACKED)
    lengths = batch["prompt_lengths"] + batch["response_lengths"]
    out["scores"] = reward.score({"tokens": batch["tokens"], "score_positions": lengths - 1})
    release_model_parallel()
    return out


def test_sft_dpo_the_critic_and_the_reward_model_split_as_on_one_rank():
    """CP2 ring: SFT's and DPO's gradients, the critic's values and value-loss gradients, the reward model's scores
    (≤ 1e-5; gradients of the largest)."""
    expected = run_ranks(_other_roles, 1, ParallelConfig(1, 1))[0]
    for got in run_ranks(_other_roles, 2, _ring()):
        for key in ("values", "scores"):
            assert (got[key] - expected[key]).abs().max().item() <= TOLERANCE, key
        for stage in ("sft", "dpo", "critic"):
            largest = max(g.abs().max().item() for g in expected[stage].values())
            assert largest > 1e-3
            for name, grad in expected[stage].items():
                diff = (got[stage][name] - grad).abs().max().item()
                assert diff <= TOLERANCE * largest, f"{stage}: gradient of {name} differs by {diff:.2e}"


def _checkpointed(rank: int, roots: dict[str, str], saving: bool) -> dict[str, dict]:
    """Saving: at CP2 (one data-parallel rank) an update, a checkpoint in each format, and the next update's metrics.
    Else: at CP1 (two data-parallel ranks) each checkpoint loaded and that next update's metrics."""
    arch = load_model_arch("tiny_qwen")
    batch = long_tailed_batch(arch.padded_vocab_size)
    out = {}
    for fmt, root in roots.items():
        release_model_parallel()
        cfg = dataclasses.replace(BASE, mini_batch_size=batch["tokens"].shape[0], micro_batch_size=3,
                                  batching=PACKED, ckpt_format=fmt)
        actor = ActorWorker(arch, _ring() if saving else ParallelConfig(1, 1), cfg,
                            weights=sharding.random_full_state_dict(arch, seed=4))
        if saving:
            actor.update(batch)
            actor.save_checkpoint(root, 1)
            actor.finish_saves()
        else:
            actor.load_checkpoint(root, load_rng=False)
        out[fmt] = actor.update(batch)
    release_model_parallel()
    return out


def test_a_checkpoint_saved_at_cp2_resumes_at_cp1_in_either_format(tmp_path):
    """CP cuts sequences, not weights: the weights and Adam's moments saved at CP2 (written by one CP rank) take the
    next update at CP1 as the CP2 run took it."""
    roots = {fmt: str(tmp_path / fmt) for fmt in ("torch", "torch_dist")}
    expected = run_ranks(_checkpointed, 2, roots, True)[0]
    for got in run_ranks(_checkpointed, 2, roots, False):
        for fmt in roots:
            assert expected[fmt]["grad_norm"] > 1e-3
            for key in ("grad_norm", "pg_loss", "kl_loss", "entropy"):
                assert got[fmt][key] == pytest.approx(expected[fmt][key], rel=1e-5, abs=1e-7), (fmt, key)
