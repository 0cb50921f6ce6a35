"""Padding-free packed micro-batches and token budgets (mindrl/models/micro_batches.py): every token keeps the
context it has in its own row; log-probs, entropies, gradients and metrics equal the padded rows' at TP2 with
sequence parallelism, PP2, DP2 and one rank, for a dense model and a mixture of experts (router losses included,
EP2); a budget never lets a micro-batch hold more tokens than it allows, and a mini-batch's gradient does not
depend on how the budget cut it, for every loss aggregation mode."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.config.batching import Batching
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.models.micro_batches import balanced_shares, cut, pack_rows
from mindrl.models.prompt_packing import prompt_groups
from mindrl.workers.megatron_worker import ActorWorker
from tests.grads import reduced_grads
from tests.test_actor_layouts import BASE, MODES
from tests.test_prompt_packing import grouped_batch

# three prompts with four samples each, long-tailed: most responses short, one of each group long
PROMPTS, RESPONSES = (5, 9, 7), ((3, 30, 1, 6), (2, 4, 45, 8), (12, 1, 3, 5))
PACKED = Batching(remove_padding=True)
#: cuts the batch into 5 micro-batches on one rank, into 2 and 3 on two data-parallel ranks
BUDGET = Batching(remove_padding=True, max_tokens=40)
BALANCED = Batching(remove_padding=True, max_tokens=40, balance=True)


def long_tailed_batch(vocab: int, seed: int = 3) -> dict:
    batch = grouped_batch(vocab, seed, PROMPTS, RESPONSES)
    gen = torch.Generator().manual_seed(9)
    rows, width = batch["tokens"].shape
    batch["old_log_probs"] = torch.full((rows, width), -6.9) + 0.3 * torch.randn(rows, width, generator=gen)
    batch["ref_log_probs"] = torch.full((rows, width), -6.95)
    batch["advantages"] = torch.randn(rows, 1, generator=gen).expand(rows, width) * batch["loss_mask"]
    return batch


def test_a_packed_sequence_gives_every_scored_token_its_own_rows_context():
    """For each scored token: the packed position that scores it holds the token it follows, at the RoPE position
    it has in its row, and its segment sees exactly the packed copies of that row's earlier tokens."""
    batch = grouped_batch(50, prompts=PROMPTS, responses=RESPONSES)
    tokens, prompts = batch["tokens"], batch["prompt_lengths"]
    lengths = prompts + batch["response_lengths"]
    for shared in (True, False):
        groups = prompt_groups(tokens, prompts) if shared else None
        packed = pack_rows(tokens, lengths, prompts, groups, width=203, multiple=8)
        assert packed.tokens.shape == (1, 208) and packed.shared == shared
        assert packed.real == int(lengths.sum() - (prompts[1::4].sum() * 3 if shared else 0))
        flat, positions, seg = packed.tokens[0], packed.position_ids[0], packed.segments
        visible = {}  # packed index → the packed indices its query sees
        for start, n, (first, prefix) in zip(seg.starts, seg.lengths, seg.prefixes, strict=True):
            for i in range(n):
                visible[start + i] = set(range(first, first + prefix)) | set(range(start, start + i + 1))
        for row in range(tokens.shape[0]):
            p, end = int(prompts[row]), int(lengths[row])
            assert (packed.source[row, :p - 1] == -1).all() and (packed.source[row, end:] == -1).all()
            for t in range(p - 1, end):
                src = int(packed.source[row, t])
                assert flat[src] == tokens[row, t] and positions[src] == t
                assert sorted(int(flat[k]) for k in visible[src]) == sorted(tokens[row, :t + 1].tolist())
                assert {int(positions[k]) for k in visible[src]} == set(range(t + 1))
        assert (flat[packed.real:] == 0).all()


def test_a_budget_cuts_rows_in_order_and_no_micro_batch_exceeds_it():
    """Rows that share a prompt cost only their responses after the first; a sample longer than the budget is
    alone; max_rows caps the rows."""
    lengths = [10, 14, 12, 100, 11, 8, 9]
    prompts = [6, 6, 6, 6, 4, 4, 4]
    groups = [range(0, 4), range(4, 7)]
    cuts = cut(lengths, prompts, groups, 2, Batching(remove_padding=True, max_tokens=30))
    assert [list(c) for c in cuts] == [[0, 1, 2], [3], [4, 5, 6]]  # 10 + 8 + 6; 100 alone; 11 + 4 + 5
    assert [list(c) for c in cut(lengths, None, groups, 2, Batching(remove_padding=True, max_tokens=30))] == \
        [[0, 1], [2], [3], [4, 5, 6]]  # without sharing each row costs its whole length: 24, 12, 100, 28
    capped = cut(lengths, prompts, groups, 2, Batching(remove_padding=True, max_tokens=30, max_rows=2))
    assert [list(c) for c in capped] == [[0, 1], [2], [3], [4, 5], [6]]
    assert [list(c) for c in cut(lengths, prompts, groups, 3, PACKED)] == [[0, 1, 2], [3, 4, 5], [6]]


def test_budget_keys_refuse_what_they_cannot_mean():
    with pytest.raises(ConfigError, match="use_remove_padding: true"):
        Batching(max_tokens=4096)
    with pytest.raises(ConfigError, match="use_dynamic_bsz"):
        Batching(remove_padding=True, max_rows=4)
    with pytest.raises(ConfigError, match="positive integer"):
        Batching(remove_padding=True, max_tokens=0)


def _passes(rank: int, arch_name: str, par: ParallelConfig, micro: int, batchings: dict[str, Batching],
            packing: str = "auto", loss: dict | None = None) -> dict:
    arch = load_model_arch(arch_name)
    full = sharding.random_full_state_dict(arch, seed=4)
    batch = long_tailed_batch(arch.padded_vocab_size)
    out = {}
    for name, batching in batchings.items():
        release_model_parallel()
        cfg = dataclasses.replace(BASE, mini_batch_size=batch["tokens"].shape[0], micro_batch_size=micro,
                                  batching=batching, prompt_packing="off" if name == "padded" else packing,
                                  loss=dataclasses.replace(BASE.loss, **(loss or {})))
        worker = ActorWorker(arch, par, cfg, weights=full)
        scores = worker.compute_log_prob(batch, with_entropy=True)
        metrics = worker.update(batch)
        rows = worker.rows_for(batch, worker.batching)
        out[name] = {"scores": scores, "metrics": metrics, "grads": reduced_grads(worker), "rows": rows,
                     "packed": worker.packed}
    return out


def _assert_same(runs: list[dict], mask: torch.Tensor, scores_only: tuple[str, ...] = ()) -> None:
    """Each run's passes equal its padded one's (the scores put together over the ranks in the batch's order: a
    balanced pass gives each rank rows from anywhere); those named in `scores_only` in their log-probs and
    entropies."""
    scores: dict[str, dict[str, torch.Tensor]] = {}
    for result in runs:
        for name, got in result.items():
            if got["scores"] is not None:
                for key, value in got["scores"].items():
                    scores.setdefault(name, {}).setdefault(key, torch.zeros(mask.shape))[got["rows"]] = value
    for name, got in scores.items():
        for key in ("log_probs", "entropy"):
            diff = (got[key] - scores["padded"][key])[mask.bool()].abs().max().item()
            assert diff <= 1e-6, f"{name}: {key} differs by {diff:.2e}"
    for result in runs:
        expected = result.pop("padded")
        assert max(g.abs().max().item() for g in expected["grads"].values()) > 1e-3
        for name, got in result.items():
            if name in scores_only:
                continue
            largest = max(g.abs().max().item() for g in expected["grads"].values())
            for key, grad in expected["grads"].items():
                diff = (got["grads"][key] - grad).abs().max().item()
                assert diff <= 1e-6 * largest, f"{name}: gradient of {key} differs by {diff:.2e}"
            # the experts' load counts every routed token, the padded rows' padding too
            for key, value in expected["metrics"].items():
                if key not in ("prompt_packed", "grad_norm", "lr") and not key.startswith("moe/load_max"):
                    assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), f"{name}: {key}"
            assert got["metrics"]["grad_norm"] == pytest.approx(expected["metrics"]["grad_norm"], rel=1e-5)


DENSE_LAYOUTS = {"one rank": (ParallelConfig(1, 1), 1), "tp2 with sequence parallelism":
                 (ParallelConfig(2, 1, sequence_parallel=True), 2), "pp2": (ParallelConfig(1, 2), 2),
                 "dp2": (ParallelConfig(1, 1), 2),
                 "tp2 pp2 with sequence parallelism": (ParallelConfig(2, 2, sequence_parallel=True), 4)}


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_packed_and_budgeted_passes_equal_the_padded_rows(layout):
    """Log-probs and entropies ≤ 1e-6 (fp32), gradients ≤ 1e-6 × the largest, the update's metrics: packed with the
    prompts shared, packed without, cut by a token budget (different micro-batch counts per DP rank), and that with
    the data-parallel shares balanced."""
    par, world = DENSE_LAYOUTS[layout]
    batchings = {"padded": Batching(), "packed": PACKED, "budget": BUDGET, "balanced budget": BALANCED}
    runs = run_ranks(_passes, world, "tiny_qwen", par, 3, batchings)
    assert any(r["packed"]["packed"] for r in runs)
    if layout == "dp2":  # the balanced ranks hold rows of both halves of the batch
        assert not torch.equal(runs[0]["balanced budget"]["rows"], torch.arange(6))
    batch = grouped_batch(10, prompts=PROMPTS, responses=RESPONSES)
    _assert_same(runs, batch["loss_mask"])
    unshared = run_ranks(_passes, world, "tiny_qwen", par, 3, {"padded": Batching(), "packed": PACKED}, "off")
    assert not any(r["packed"]["packed"] for r in unshared)
    _assert_same(unshared, batch["loss_mask"])


MOE_LAYOUTS = {"ep2": ParallelConfig(1, 1, expert_model_parallel_size=2),
               "tp2 with sequence parallelism": ParallelConfig(2, 1), "pp2": ParallelConfig(1, 2)}


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_a_mixture_of_experts_packs_with_its_router_losses(layout):
    """Packed without sharing prompts, the routers' load-balancing loss counts the same real tokens as padded, so
    the gradients agree with the micro-batches cut alike (a shared prompt is one copy, counted once); a token
    budget cuts them otherwise (megatron-core's router losses are per micro-batch), so there only the scores are
    compared, and under EP2 the rank with fewer micro-batches runs stand-ins that keep the experts' all-to-all in
    step."""
    batch = grouped_batch(10, prompts=PROMPTS, responses=RESPONSES)
    batchings = {"padded": Batching(), "packed": PACKED, "budget": BUDGET}
    runs = run_ranks(_passes, 2, "tiny_qwen3_moe", MOE_LAYOUTS[layout], 3, batchings, "off")
    _assert_same(runs, batch["loss_mask"], scores_only=("budget",))


def _hf_scored(rank: int, checkpoint: str, batch: dict) -> dict | None:
    from mindrl.checkpoint import megatron as mg
    from mindrl.workers.megatron_worker import MegatronWorker

    args = mg.load_args(checkpoint)
    par = dataclasses.replace(mg.parallel_of(args), sequence_parallel=True)
    worker = MegatronWorker(mg.arch_of(args), par, weights=checkpoint, temperature=0.7, batching=BUDGET)
    assert worker.model.config.sequence_parallel
    return worker.compute_log_prob(batch, with_entropy=True)


def hf_scored_rows(tmp_path, kind: str, tp: int) -> tuple[str, dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tiny HF model of `kind` converted at TP=`tp`, the long-tailed batch, and HF's own log-probs and entropies of
    each padded row at temperature 0.7 ([rows, S − 1]) with the response positions they are compared at."""
    from mindrl.ckpt_convert import hf_to_mcore
    from tests.hf_models import build_hf_model, save_hf_model

    model = build_hf_model(kind, seed=7)
    checkpoint = hf_to_mcore(save_hf_model(model, tmp_path / "hf"), tmp_path / "mg", kind, tp, 1,
                             params_dtype=torch.float32, progress=False)
    batch = grouped_batch(250, prompts=PROMPTS, responses=RESPONSES)
    lengths = batch["prompt_lengths"] + batch["response_lengths"]
    attention = (torch.arange(batch["tokens"].shape[1]) < lengths.unsqueeze(1)).long()
    with torch.no_grad():
        log_softmax = torch.log_softmax(model(batch["tokens"], attention_mask=attention).logits / 0.7, dim=-1)
    expected = log_softmax[:, :-1].gather(-1, batch["tokens"][:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)[:, :-1]
    return str(checkpoint), batch, expected, entropy, batch["loss_mask"].bool()[:, :-1]


def test_budgeted_packed_log_probs_equal_hf_transformers_scoring_each_row(tmp_path):
    """At TP2 with sequence parallelism (the packed length padded to a multiple of 2), HF's own model scoring each
    padded row with its attention mask is the oracle."""
    checkpoint, batch, expected, entropy, mask = hf_scored_rows(tmp_path, "qwen2", 2)
    out = [r for r in run_ranks(_hf_scored, 2, checkpoint, batch) if r is not None][-1]
    assert (out["log_probs"][:, :-1] - expected)[mask].abs().max().item() < 1e-5
    assert (out["entropy"][:, :-1] - entropy)[mask].abs().max().item() < 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_a_budgets_cut_leaves_the_mini_batchs_gradient_as_it_is_for_every_aggregation_mode(mode):
    """DP2: the ranks cut their rows into 2 and 3 micro-batches; the normalisers are the mini-batch's totals."""
    runs = run_ranks(_passes, 2, "tiny_qwen", ParallelConfig(1, 1), 3, {"padded": Batching(), "budget": BUDGET},
                     "auto", {"loss_agg_mode": mode})
    _assert_same(runs, grouped_batch(10, prompts=PROMPTS, responses=RESPONSES)["loss_mask"])


def _sft_and_dpo(rank: int, batchings: dict[str, Batching]) -> dict:
    from mindrl.algorithms.dpo_loss import DPOLossConfig

    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=4)
    # four chosen/rejected pairs, each pair's rows sharing their prompt
    batch = grouped_batch(arch.padded_vocab_size, 5, (5, 9, 7, 6), ((3, 30), (2, 45), (12, 1), (7, 8)))
    rows = batch["tokens"].shape[0]
    sft = {"tokens": batch["tokens"], "loss_mask": batch["loss_mask"]}
    noise = 0.3 * torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(2))
    dpo = {**batch, "ref_log_probs": (noise - 6.9) * batch["loss_mask"]}
    out = {}
    for name, batching in batchings.items():
        cfg = dataclasses.replace(BASE, mini_batch_size=rows, micro_batch_size=2, batching=batching,
                                  prompt_packing="off" if name == "padded" else "auto")
        grads = {}
        for stage in ("sft", "dpo") if batching.max_tokens is None else ("sft",):
            release_model_parallel()
            worker = ActorWorker(arch, ParallelConfig(1, 1), cfg, weights=full)
            if stage == "sft":
                worker.sft_step(sft)
            else:
                worker.dpo_step(dpo, DPOLossConfig())
            grads[stage] = reduced_grads(worker)
        out[name] = grads
    return out


def test_sft_and_dpo_steps_packed_have_the_padded_rows_gradients():
    """DP2; SFT also cut by a token budget (DPO keeps each pair whole in one micro-batch, so it takes none)."""
    runs = run_ranks(_sft_and_dpo, 2, {"padded": Batching(), "packed": PACKED, "budget": BUDGET})
    for result in runs:
        for stage in ("sft", "dpo"):
            expected = result["padded"][stage]
            largest = max(g.abs().max().item() for g in expected.values())
            assert largest > 1e-3
            for name in ("packed", "budget") if stage == "sft" else ("packed",):
                for key, grad in expected.items():
                    diff = (result[name][stage][key] - grad).abs().max().item()
                    assert diff <= 1e-6 * largest, f"{stage} {name}: gradient of {key} differs by {diff:.2e}"


def test_balanced_shares_even_out_a_long_tail_and_keep_prompts_together_where_that_costs_little():
    """As many rows per rank, every row once; the heaviest rank within 10 % of the larger of the mean and the
    heaviest row, and below the contiguous split's; over 2 ranks whole prompt groups stay together."""
    gen = torch.Generator().manual_seed(0)
    costs = (128 * torch.exp(1.19 * torch.randn(64, generator=gen))).tolist()
    groups = [range(start, start + 4) for start in range(0, 64, 4)]
    for ranks in (2, 4, 8):
        shares = balanced_shares(costs, groups, ranks)
        assert sorted(row for share in shares for row in share) == list(range(64))
        assert all(len(share) == 64 // ranks for share in shares)
        heaviest = max(sum(costs[row] for row in share) for share in shares)
        contiguous = max(sum(costs[r * 64 // ranks:(r + 1) * 64 // ranks]) for r in range(ranks))
        assert heaviest < contiguous and heaviest <= 1.1 * max(sum(costs) / ranks, max(costs))
        if ranks == 2:
            assert all(set(groups[row // 4]) <= set(share) for share in shares for row in share)
    single = balanced_shares(costs[:6], [range(0, 4), range(4, 6)], 2)  # unequal groups: rows are balanced
    assert [len(share) for share in single] == [3, 3]
