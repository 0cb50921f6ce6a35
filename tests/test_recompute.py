"""Activation recompute (mindrl/models/recompute.py): full (uniform groups, the first layers of each stage) and
selective (the attention core) give the gradients and metrics of no recompute bit for bit, on padded rows, rows
packed behind shared prompts and padding-free packed micro-batches, on one rank and across two pipeline stages;
conflicting keys are one sentence each."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.config.batching import Batching
from mindrl.config.recompute import Recompute
from mindrl.distributed import release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.workers.megatron_worker import ActorWorker
from tests.grads import reduced_grads
from tests.test_actor_layouts import BASE
from tests.test_packed_micro_batches import long_tailed_batch

RECOMPUTES = {"none": Recompute(), "full uniform 2": Recompute("full", "uniform", 2),
              "full block 1": Recompute("full", "block", 1), "selective": Recompute("selective")}
#: how the rows reach the model: padded, packed behind shared prompts (PackedLayout), packed without padding
ROWS = {"padded": ("off", Batching()), "prompt packed": ("on", Batching()),
        "padding-free": ("auto", Batching(remove_padding=True, max_tokens=40))}


def _updates(rank: int, par: ParallelConfig) -> dict:
    arch = load_model_arch("tiny_qwen")
    full = sharding.random_full_state_dict(arch, seed=4)
    batch = long_tailed_batch(arch.padded_vocab_size)
    out = {}
    for rows, (packing, batching) in ROWS.items():
        for name, recompute in RECOMPUTES.items():
            release_model_parallel()
            cfg = dataclasses.replace(BASE, mini_batch_size=batch["tokens"].shape[0], micro_batch_size=3,
                                      prompt_packing=packing, batching=batching, recompute=recompute)
            worker = ActorWorker(arch, par, cfg, weights=full)
            calls = _count_forwards(worker)
            metrics = worker.update(batch)
            out[rows, name] = {"grads": reduced_grads(worker), "metrics": metrics, "calls": calls}
    return out


def _count_forwards(worker: ActorWorker) -> dict[str, int]:
    """How often the stage's layers and their attention cores run forward (a recomputed one runs twice)."""
    calls = {"layers": 0, "cores": 0}

    def layer_ran(*_):
        calls["layers"] += 1

    for layer in worker.model.decoder.layers:
        layer.register_forward_pre_hook(layer_ran)  # a recompute may stop before a layer ends
        core = layer.self_attention.core_attention

        def counted(*args, original=core._core):
            calls["cores"] += 1
            return original(*args)

        core._core = counted
    return calls


@pytest.mark.parametrize("par, world", [(ParallelConfig(1, 1), 1), (ParallelConfig(1, 2), 2)], ids=["one rank", "pp2"])
def test_recompute_leaves_the_gradients_as_they_are_to_the_bit(par, world):
    """And it happens: full recompute runs every layer's forward twice (uniform) or the stage's first layer twice
    (block 1), selective every attention core twice and each layer once."""
    layers = 4 // world
    for result in run_ranks(_updates, world, par):
        for rows in ROWS:
            plain = result[rows, "none"]
            once = plain["calls"]["layers"] // layers  # micro-batches
            assert plain["calls"] == {"layers": once * layers, "cores": once * layers}
            assert result[rows, "full uniform 2"]["calls"] == {"layers": 2 * once * layers, "cores": 2 * once * layers}
            assert result[rows, "full block 1"]["calls"] == {"layers": once * (layers + 1),
                                                             "cores": once * (layers + 1)}
            assert result[rows, "selective"]["calls"] == {"layers": once * layers, "cores": 2 * once * layers}
            assert max(g.abs().max().item() for g in plain["grads"].values()) > 1e-3
            for name in RECOMPUTES:
                got = result[rows, name]
                for key, grad in plain["grads"].items():
                    assert torch.equal(got["grads"][key], grad), f"{rows}, {name}: gradient of {key}"
                assert got["metrics"] == plain["metrics"], f"{rows}, {name}"


@pytest.mark.parametrize("recompute, words", [
    (Recompute("selective", "uniform", 2), ["granularity: selective", "conflict"]),
    (Recompute(None, "block", 2), ["granularity is unset"]),
    (Recompute("full"), ["full needs", "uniform", "block"]),
    (Recompute("full", "block"), ["num_layers", "positive integer"]),
    (Recompute("partial"), ["full or selective"]),
])
def test_recompute_keys_that_conflict_are_one_sentence(recompute, words):
    with pytest.raises(ConfigError) as err:
        recompute.check("actor_config")
    message = str(err.value)
    assert "\n" not in message and all(word in message for word in words), message
    with pytest.raises(ConfigError, match="exceeds the 2 layers"):
        Recompute("full", "block", 3).check("actor_config", layers_per_stage=2)


def _moe_updates(rank: int) -> dict:
    arch = load_model_arch("tiny_qwen3_moe")
    full = sharding.random_full_state_dict(arch, seed=4)
    batch = long_tailed_batch(arch.padded_vocab_size)
    out = {}
    for name in ("none", "full uniform 2"):
        release_model_parallel()
        cfg = dataclasses.replace(BASE, mini_batch_size=batch["tokens"].shape[0], micro_batch_size=3,
                                  batching=ROWS["padding-free"][1], recompute=RECOMPUTES[name])
        worker = ActorWorker(arch, ParallelConfig(1, 1), cfg, weights=full)
        out[name] = {"metrics": worker.update(batch), "grads": reduced_grads(worker)}
    return out


def test_a_recomputed_mixture_of_experts_logs_its_routers_once():
    """The recomputed layers run their routers again in the backward: the load-balancing loss megatron-core tracks
    and the experts' load mindrl counts are each micro-batch's once, as without recompute."""
    result = run_ranks(_moe_updates, 1)[0]
    plain, full = result["none"], result["full uniform 2"]
    assert plain["metrics"]["moe/load_balancing_loss"] > 0
    assert full["metrics"] == plain["metrics"]
    assert all(torch.equal(full["grads"][key], grad) for key, grad in plain["grads"].items())
