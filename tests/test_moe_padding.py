"""The mixture-of-experts routers' load-balancing and z-losses count real tokens only: right padding and the
filler rows of a short micro-batch change neither the losses nor the routers' gradients, on one rank, under
tensor parallelism with sequence parallelism, across pipeline stages, and both at once; and over rows of
different lengths the load-balancing loss is HF transformers' with its attention mask, the z-loss the mean over
the real tokens of the squared log-sum-exp of HF's router logits, and the routers' gradients those of HF's two
losses.

Under sequence parallelism megatron-core averages the z-loss over each tensor-parallel rank's own shard of the
sequence, so padding that falls unevenly on the shards reweights it: that layout is checked without a z-loss.

HF pools one load-balancing loss over its layers and sums the top-k picks; megatron-core adds one loss per
layer, each 1 / top-k of HF's formula applied to that layer alone (moe_aux_loss_coeff's meaning, docs/moe.md).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from mindrl.config import ParallelConfig, load_model_arch
from mindrl.distributed import init_model_parallel, release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import hf_mapping as hfm
from mindrl.models import sharding
from mindrl.models.forward import run_microbatches
from mindrl.models.gpt import build_gpt_model, load_stage_weights
from mindrl.models.optimizer import wrap_for_training, zero_grads
from mindrl.workers.megatron_worker import ActorConfig, ActorWorker, real_lengths
from tests.hf_models import build_hf_model, checkpoint_state, hf_to_mcore_state

AUX, Z = 0.01, 0.001
#: name → (layout, whether the z-loss is on)
LAYOUTS = {"one rank": (ParallelConfig(1, 1), True), "tp2 with sequence parallelism": (ParallelConfig(2, 1), False),
           "pp2": (ParallelConfig(1, 2), True), "tp2 pp2 with sequence parallelism": (ParallelConfig(2, 2), False)}
ROWS, REAL, WIDTH = 4, 10, 16
RAGGED = (16, 11, 6, 3)


def _cases() -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """name → (tokens, padding mask): equal rows without padding; the same rows right-padded, with a filler
    row; rows of different lengths, right-padded."""
    tokens = torch.randint(1, 250, (ROWS, WIDTH), generator=torch.Generator().manual_seed(5))
    padded = torch.cat([tokens, torch.zeros(1, WIDTH, dtype=torch.long)])
    padded[:, REAL:] = 0
    lengths = torch.tensor([REAL] * ROWS + [0])
    ragged = tokens.clone()
    ragged_lengths = torch.tensor(RAGGED)
    ragged[torch.arange(WIDTH) >= ragged_lengths.unsqueeze(1)] = 0
    return {"plain": (tokens[:, :REAL], None),
            "padded": (padded, torch.arange(WIDTH) >= lengths.unsqueeze(1)),
            "ragged": (ragged, torch.arange(WIDTH) >= ragged_lengths.unsqueeze(1))}


def _router_losses(rank: int, arch, full: dict, cases: dict, layouts: list) -> list[dict]:
    """Per layout and case: each layer's load-balancing and z-loss (megatron-core's tracker, before their
    coefficients) and its router's gradient, from a pass whose only loss is the routers'."""
    out = []
    for par, z_loss in layouts:
        arch = dataclasses.replace(arch, moe_z_loss_coeff=Z if z_loss else None)
        moe_utils.get_moe_layer_wise_logging_tracker().clear()  # the last layout's names
        release_model_parallel()
        init_model_parallel(par, arch=arch)
        model = build_gpt_model(arch, par)
        tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
        load_stage_weights(model, sharding.shard_state_dict(full, arch, par, tp, pp, 0))
        ddp, optimizer = wrap_for_training(model, lr=0.0, use_distributed_optimizer=False)
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        results = {}
        for name, (tokens, mask) in cases.items():
            zero_grads(ddp, optimizer)
            batch = {"tokens": tokens, **({"padding_mask": mask} if mask is not None else {})}
            run_microbatches(ddp, [batch], lambda logits, mb: (logits.sum() * 0.0, {}))
            moe_utils.reduce_aux_losses_tracker_across_ranks()
            tracker = moe_utils.get_moe_layer_wise_logging_tracker()
            losses = {key: entry["values"].clone() for key, entry in tracker.items()}
            moe_utils.clear_aux_losses_tracker()
            grads = {r.layer_number: r.weight.main_grad.detach().clone() for r in routers}
            results[name] = {"losses": losses, "grads": grads, "tp": tp}
        out.append(results)
    return out


def _hf_reference(hf, tokens: torch.Tensor, lengths: torch.Tensor, top_k: int, experts: int, z_coeff: float) -> dict:
    """HF's per-layer load-balancing loss with the attention mask, the z-loss over the real tokens, and the
    gates' gradients of Σ_layers (AUX · lb / top-k + z_coeff · z)."""
    hf.zero_grad()
    real = (torch.arange(tokens.shape[1]) < lengths.unsqueeze(1)).long()
    logits = hf(tokens, attention_mask=real, output_router_logits=True).router_logits
    flat = real.reshape(-1).bool()
    lb = torch.stack([load_balancing_loss_func((layer,), experts, top_k, real) for layer in logits])
    z = torch.stack([torch.logsumexp(layer[flat], dim=-1).square().mean() for layer in logits])
    (AUX * lb.sum() / top_k + z_coeff * z.sum()).backward()
    grads = {i + 1: hf.model.layers[i].mlp.gate.weight.grad.clone() for i in range(len(logits))}
    return {"lb": lb.detach(), "z": z.detach(), "grads": grads}


@pytest.fixture(scope="module")
def runs():
    hf = build_hf_model("qwen3_moe", seed=7, num_hidden_layers=2)
    arch = dataclasses.replace(hfm.arch_from_hf_config(hf.config.to_dict(), "qwen3_moe", name="qwen3_moe"),
                               moe_router_dtype="fp32", moe_aux_loss_coeff=AUX)
    full = hf_to_mcore_state(checkpoint_state(hf), arch)
    cases = _cases()
    per_rank = run_ranks(_router_losses, 4, arch, full, cases, list(LAYOUTS.values()))
    expected = {z_loss: _hf_reference(hf, cases["ragged"][0], torch.tensor(RAGGED), arch.moe_router_topk,
                                      arch.num_experts, Z if z_loss else 0.0) for z_loss in (True, False)}
    return per_rank, expected, arch


def _layout(per_rank: list, index: int) -> dict:
    """A layout's results with every stage's routers' gradients together (tensor-parallel rank 0's)."""
    merged: dict = {}
    for rank in per_rank:
        for name, result in rank[index].items():
            if result["tp"] == 0:
                entry = merged.setdefault(name, {"losses": result["losses"], "grads": {}})
                entry["grads"].update(result["grads"])
    return merged


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_padding_changes_neither_the_router_losses_nor_their_gradients(runs, layout):
    per_rank, _, arch = runs
    result = _layout(per_rank, list(LAYOUTS).index(layout))
    plain, padded = result["plain"], result["padded"]
    assert set(plain["losses"]) == ({"load_balancing_loss", "z_loss"} if LAYOUTS[layout][1] else
                                    {"load_balancing_loss"})
    for key, values in plain["losses"].items():
        assert values.shape == (arch.num_layers,) and values.abs().min() > 0
        assert torch.allclose(padded["losses"][key], values, rtol=1e-5, atol=0), (key, padded["losses"][key], values)
    assert sorted(plain["grads"]) == list(range(1, arch.num_layers + 1))
    for layer, grad in plain["grads"].items():
        assert grad.abs().max() > 0
        assert torch.allclose(padded["grads"][layer], grad, rtol=1e-4, atol=1e-6 * grad.abs().max().item()), layer


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_router_losses_of_rows_of_different_lengths_are_hfs(runs, layout):
    per_rank, references, arch = runs
    z_loss = LAYOUTS[layout][1]
    expected = references[z_loss]
    ragged = _layout(per_rank, list(LAYOUTS).index(layout))["ragged"]
    lb = ragged["losses"]["load_balancing_loss"]
    assert torch.allclose(lb * arch.moe_router_topk, expected["lb"], rtol=1e-5), (lb, expected["lb"])
    if z_loss:
        assert torch.allclose(ragged["losses"]["z_loss"], expected["z"], rtol=1e-5), (ragged["losses"], expected)
    for layer, grad in expected["grads"].items():
        scale = grad.abs().max().item()
        assert (ragged["grads"][layer] - grad).abs().max().item() <= 1e-5 * scale, layer


def test_a_rows_real_tokens_come_from_its_lengths_or_its_last_scored_position():
    tokens = torch.ones(3, 8, dtype=torch.long)
    lengths = {"prompt_lengths": torch.tensor([2, 3, 1]), "response_lengths": torch.tensor([4, 5, 0])}
    assert real_lengths({"tokens": tokens, **lengths}).tolist() == [6, 8, 1]
    loss_mask = torch.zeros(3, 8)
    loss_mask[0, 1:4] = 1  # scores tokens 2..4: the row ends at its EOS, token 4
    loss_mask[1, 2:7] = 1
    assert real_lengths({"tokens": tokens, "loss_mask": loss_mask}).tolist() == [5, 8, 8]
    assert real_lengths({"tokens": tokens}).tolist() == [8, 8, 8]


def _worker_passes(rank: int) -> dict:
    """An MoE actor's update of rows of different lengths, at their own width and with five more padding
    columns (two data-parallel ranks); and the micro-batches that an actor with plain rows, one that packs
    prompts and one at TP=2 (sequence-parallel) make of three of them."""
    arch = load_model_arch("tiny_qwen3_moe")
    full = sharding.random_full_state_dict(arch, seed=4, std=0.1)
    cfg = ActorConfig(lr=0.0, mini_batch_size=4, micro_batch_size=2, prompt_packing="off")
    prompts, responses = torch.tensor([3, 3, 4, 4]), torch.tensor([6, 4, 5, 2])
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(1, arch.padded_vocab_size, (4, 14), generator=gen)
    tokens[:, 3:] = torch.randint(1, arch.padded_vocab_size, (4, 11), generator=gen)
    tokens[2:, :4] = tokens[2, :4]  # rows 0-1 and 2-3 share a prompt
    tokens[:2, :3] = tokens[0, :3]
    tokens[torch.arange(14) >= (prompts + responses).unsqueeze(1)] = 0
    loss_mask = ((torch.arange(14) >= prompts.unsqueeze(1) - 1) &
                 (torch.arange(14) < (prompts + responses).unsqueeze(1) - 1)).float()
    batch = {"tokens": tokens, "loss_mask": loss_mask, "prompt_lengths": prompts, "response_lengths": responses,
             "advantages": torch.randn(4, 1, generator=gen) * loss_mask}
    out = {}
    for width in (9, 14):
        release_model_parallel()
        actor = ActorWorker(arch, ParallelConfig(1, 1), cfg, weights=full)
        out[width] = actor.update({k: v[:, :width] if v.ndim == 2 else v for k, v in batch.items()})
    narrow = {k: v[:, :9] if v.ndim == 2 else v for k, v in batch.items()}
    out["plain"] = [mb["padding_mask"].cpu() for mb in actor._micro_batches(narrow, slice(0, 3), 2)]
    release_model_parallel()
    packing = ActorWorker(arch, ParallelConfig(1, 1), dataclasses.replace(cfg, prompt_packing="on"), weights=full)
    out["packed"] = [{k: mb[k].cpu() for k in ("tokens", "padding_mask")}
                     for mb in packing._micro_batches(batch, slice(0, 3), 2)]
    release_model_parallel()
    sequence_parallel = ActorWorker(arch, ParallelConfig(2, 1), cfg, weights=full)
    out["sequence_parallel"] = [mb["padding_mask"].cpu()
                                for mb in sequence_parallel._micro_batches(narrow, slice(0, 3), 2)]
    return out


def test_an_moe_actor_hands_its_routers_the_padding_of_plain_packed_and_filler_rows():
    out = run_ranks(_worker_passes, 2)[0]
    # the same rows with five more padding columns: the same update, to the load-balancing loss
    assert out[9]["moe/load_balancing_loss"] > 0
    assert out[14]["moe/load_balancing_loss"] == pytest.approx(out[9]["moe/load_balancing_loss"], rel=1e-5)
    assert out[14]["pg_loss"] == pytest.approx(out[9]["pg_loss"], rel=1e-5)
    # rows 0-1 pack behind one prompt (3 + 6 + 4 = 13 tokens); row 2 alone (4 + 5) and a filler row of nothing;
    # every micro-batch takes the shape of the largest (two packed rows of 13)
    first, second = out["packed"]
    assert first["tokens"].shape == second["tokens"].shape == (2, 13)
    assert first["padding_mask"].tolist() == [[False] * 13, [True] * 13]
    assert second["padding_mask"].tolist() == [[False] * 9 + [True] * 4, [True] * 13]
    # plain rows of 9 and 7 tokens, then one of 9 and a filler row; at TP=2 each row gains a tenth column (a
    # sequence-parallel model cuts the sequence in two equal shards)
    plain = [[[False] * 9, [False] * 7 + [True] * 2], [[False] * 9, [True] * 9]]
    assert [mb.tolist() for mb in out["plain"]] == plain
    assert [mb.tolist() for mb in out["sequence_parallel"]] == [[[*row, True] for row in mb] for mb in plain]
