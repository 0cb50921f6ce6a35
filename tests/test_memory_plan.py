"""The memory plan (mindrl/trainer/memory_plan.py): its terms against what Megatron and autograd really hold, its
total against a CPU rank's measured peak, and its verdicts on the recipes."""

import dataclasses
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from mindrl.config import ConfigError, ParallelConfig, load_model_arch
from mindrl.config.batching import Batching
from mindrl.config.recompute import Recompute
from mindrl.launch import run_ranks
from mindrl.models.micro_batches import cut
from mindrl.trainer import memory_plan
from mindrl.trainer.config import TRAINER_CONFIGS_DIR, load_mindspeed_config, trainer_loader
from tests import jobs

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT.parent / "shared/reference/mindspeed_rl/configs"
sys.path.insert(0, str(ROOT / "bench"))
PROMPT, RESPONSE = 64, 1500


@pytest.mark.parametrize(("rows", "budget", "max_rows", "n"), [
    (2, None, None, 4), (3, None, None, 4), (6, None, None, 4), (8, None, None, 4), (1, 6000, None, 4),
    (1, 20000, None, 3), (1, 20000, 5, 3), (1, 1500, None, 4)])
def test_a_passs_largest_micro_batch_is_at_most_the_planned_one(rows, budget, max_rows, n):
    """Against the workers' own cut of a batch of 4 prompts' longest samples (a prompt's samples behind one copy of
    it): a fixed row count's largest micro-batch is the plan's, a budget's never above it."""
    prompt, response = 512, 1024
    groups = [range(g * n, (g + 1) * n) for g in range(4)]
    cuts = cut([prompt + response] * 4 * n, [prompt] * 4 * n, groups, rows,
               Batching(remove_padding=True, max_tokens=budget, max_rows=max_rows))

    def tokens(run: range) -> int:
        return sum(prompt + response * sum(1 for row in run if row // n == g) for g in {row // n for row in run})

    planned, _ = memory_plan._micro_batch(rows, budget, max_rows, prompt, response, True, n)
    largest = max(tokens(run) for run in cuts)
    assert largest == planned if budget is None else largest <= planned


def _local_parameters(rank: int, name: str, untied: bool, par: ParallelConfig) -> tuple[int, int]:
    from megatron.core import parallel_state

    from mindrl.distributed import init_model_parallel
    from mindrl.models.gpt import build_gpt_model

    arch = dataclasses.replace(load_model_arch(name), untie_embeddings_and_output_weights=untied)
    init_model_parallel(par, arch=arch)
    model = build_gpt_model(arch, par)
    return parallel_state.get_pipeline_model_parallel_rank(), sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("name", "untied", "par"), [
    ("tiny_qwen", False, ParallelConfig(2, 2)),
    ("tiny_qwen", True, ParallelConfig(2, 2, (1, 3))),
    ("tiny_qwen3_moe", False, ParallelConfig(1, 2, expert_model_parallel_size=2)),
    ("tiny_deepseek_v3", True, ParallelConfig(2, 2)),
], ids=["tied-tp2-pp2", "untied-tp2-uneven-pp2", "moe-pp2-ep2", "mla-tp2-pp2"])
def test_each_ranks_parameters_are_the_built_models(name, untied, par):
    """Per rank, against megatron-core's own model: the tied LM head's copy on the last stage, the vocabulary's
    TP padding, uneven stages, experts spread over EP."""
    arch = dataclasses.replace(load_model_arch(name), untie_embeddings_and_output_weights=untied)
    for stage, built in run_ranks(_local_parameters, 4, name, untied, par):
        assert sum(memory_plan.stage_params(arch, par, stage)) == built


def _optimizer_bytes(rank: int, bf16: bool) -> dict[str, int]:
    from long_responses import grpo_batch

    from mindrl.workers.megatron_worker import ActorConfig, ActorWorker

    arch = load_model_arch("tiny_qwen")
    cfg = ActorConfig(lr=1e-5, mini_batch_size=4, micro_batch_size=2)
    actor = ActorWorker(arch, ParallelConfig(1, 1), cfg, params_dtype=torch.bfloat16 if bf16 else torch.float32)
    actor.update(grpo_batch(arch.padded_vocab_size, [16] * 4, 4))
    optimizers = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    moments = sum(t.numel() * t.element_size() for opt in optimizers for state in opt.optimizer.state.values()
                  for t in state.values() if torch.is_tensor(t) and t.dim())
    masters = sum(p.numel() * p.element_size() for opt in optimizers
                  for group in getattr(opt, "shard_fp32_from_float16_groups", []) for p in group)
    grads = sum(buffer.grad_data.numel() * buffer.grad_data.element_size() for buffer in actor.ddp.buffers)
    weights = sum(p.numel() * p.element_size() for p in actor.model.parameters())
    return {"weights": weights, "gradients": grads, "optimizer": moments + masters}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_distributed_optimizer_holds_its_planned_share(bf16):
    """At DP2 each rank holds half of Adam's moments (and of the fp32 master weights under bf16) and the whole
    fp32 grad buffer: Megatron's own buffers, within its padding of each shard."""
    arch = load_model_arch("tiny_qwen")
    planned = memory_plan.model_state(arch, ParallelConfig(1, 1), 0, 2, bf16, True)
    for held in run_ranks(_optimizer_bytes, 2, bf16):
        for term, value in held.items():
            assert abs(value - planned[term]) <= 0.01 * planned[term], (term, value, planned[term])


def _saved_bytes(rank: int, arch: object, par: ParallelConfig, recompute: Recompute) -> int:
    """Bytes of the distinct tensors autograd keeps for one update's backward (parameters aside)."""
    from long_responses import grpo_batch

    from mindrl.workers.megatron_worker import ActorConfig, ActorWorker

    cfg = ActorConfig(lr=1e-5, mini_batch_size=2, micro_batch_size=2, batching=Batching(remove_padding=True),
                      recompute=recompute)
    actor = ActorWorker(arch, par, cfg)
    params = {p.untyped_storage().data_ptr() for p in actor.model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        actor.update(grpo_batch(arch.padded_vocab_size, [RESPONSE] * 2, 2))
    return sum(kept.values())


@pytest.mark.parametrize(("name", "tp", "sp", "recompute", "tolerance"), [
    ("tiny_qwen", 1, False, Recompute(), 0.005),
    ("tiny_qwen", 1, False, Recompute("selective"), 0.005),
    ("tiny_qwen", 1, False, Recompute("full", "uniform", 1), 1e-9),
    ("tiny_qwen", 2, True, Recompute(), 0.005),
    ("tiny_qwen", 2, False, Recompute(), 0.005),
    ("tiny_qwen3_moe", 1, False, Recompute(), 0.02),
    ("tiny_deepseek_v3", 1, False, Recompute(), 0.02),
    ("tiny_deepseek_v3", 2, True, Recompute(), 0.02),
], ids=["dense", "selective", "full", "tp2-sp", "tp2", "moe", "mla", "mla-tp2-sp"])
def test_what_a_layer_keeps_for_the_backward_is_the_planned_count(name, tp, sp, recompute, tolerance):
    """A second layer's saved tensors, counted by autograd's hooks, one sample behind the other's prompt copy (the
    fused attention kernel's lengths): the plan's elements a layer, for a dense model under each recompute and TP
    with and without sequence parallelism, up to the prompt's own score matrices (64 x 64 a head, 0.4 %), which
    the plan leaves out; exactly under full recompute; an expert layer within 2 % (its routing differs between
    the runs), DeepSeek-V3's multi-latent attention under one within 2 %, with TP and sequence parallelism too."""
    per_layer = []
    for layers in (1, 2):
        base = load_model_arch(name)
        # DeepSeek-V3's layers with experts, under its multi-latent attention
        dense_first = {"first_k_dense_replace": 0} if base.first_k_dense_replace else {}
        arch = dataclasses.replace(base, num_layers=layers, max_position_embeddings=4096, **dense_first)
        par = ParallelConfig(tp, 1, sequence_parallel=sp)
        saved = run_ranks(_saved_bytes, tp, arch, par, recompute)[0]
        planned = memory_plan.activation_bytes(arch, par, 0, PROMPT + 2 * RESPONSE, 1, recompute, 4,
                                               memory_plan.kernels("CPU"), 2 * PROMPT)
        per_layer.append((saved, planned))
    (saved1, planned1), (saved2, planned2) = per_layer
    assert abs((saved2 - saved1) - (planned2 - planned1)) <= tolerance * (planned2 - planned1)


@pytest.mark.measures
def test_the_plan_is_within_15_percent_of_a_ranks_measured_peak():
    """bench/memory_plan.py: an update at its three sizes, an update with full recompute at the smallest and a
    log-prob pass at the middle one (the smallest's 230 MiB moved by 27 MiB under the suite's load); the second
    pass's peak RSS above the RSS before the model was built. Samples of 2048 tokens: the fused attention kernel's
    lengths (shorter ones keep score matrices the plan leaves out, docs/memory_plan.md)."""
    import memory_plan as bench

    cases = [(size, "none", "update") for size in bench.SIZES] + [("h256", "full", "update"),
                                                                   ("h512", "none", "log_probs")]
    for size, recompute, what in cases:
        planned = sum(bench.planned(size, 2048, 2, recompute, what).values())
        measured = bench.measure(size, 2048, 2, recompute, what)
        assert 0.85 <= planned / measured <= 1.15, (size, recompute, what, planned / 2**20, measured / 2**20)


def _qwen25_32b(*overrides: str):
    return trainer_loader("ray_grpo")("grpo_qwen25_32b", list(overrides))


#: MindSpeed-RL's grpo_qwen25_32b_A3 layout given to mindrl's 32B recipe (TP4 x PP4 with sequence parallelism,
#: two rows a micro-batch): 16 devices, rows packed without padding, the engine at infer TP2 under 0.6 of each
A3_LAYOUT = ("rl_config.actor_resource.num_npus=16", "+rl_config.use_remove_padding=true",
             "generate_config.infer_tensor_parallel_size=2", "generate_config.max_num_seqs=64",
             "generate_config.max_num_batched_tokens=2048", "~rl_config.actor_forward_micro_batch_size")


def test_full_fine_tuning_of_qwen25_32b_on_16_devices_of_32_gib_is_refused_in_one_sentence():
    cfg = _qwen25_32b(*A3_LAYOUT, "+rl_config.device_memory_gib=32")
    with pytest.raises(ConfigError, match=r"^the actor devices \(NPU, 32.0 GiB each; .*\) would need [\d.]+ GiB in the "
                                          r"actor update; its weights, gradients and optimizer state alone need "
                                          r"[\d.]+ GiB, the largest actor optimizer at [\d.]+ GiB: shrink it with "
                                          r"more devices in rl_config.actor_resource [^\n]*\.$"):
        memory_plan.check(memory_plan.plan(cfg), cfg)


def test_mindspeed_rl_s_32b_layout_fits_16_devices_of_64_gib():
    cfg = _qwen25_32b(*A3_LAYOUT)
    [actor] = memory_plan.plan(cfg)
    memory_plan.check([actor], cfg)
    assert actor.ranks == 16 and 48 * memory_plan.GIB < actor.peak.total <= 64 * memory_plan.GIB
    assert actor.kv_cache[1] >= cfg.generate_config.max_model_len


def test_swap_optimizer_holds_the_optimizer_state_in_the_optimizer_step_alone():
    """MindSpeed's swap_optimizer: the state leaves the update's forward and backward and the generation for a phase
    of its own, the step, with the weights and gradients."""
    plain = {p.name: p for p in memory_plan.plan(_qwen25_32b(*A3_LAYOUT))[0].phases}
    swapped = {p.name: p for p in memory_plan.plan(_qwen25_32b(*A3_LAYOUT,
                                                               "+megatron_training.swap_optimizer=true"))[0].phases}
    optimizer = {t.name: t.bytes for t in plain["actor update"].terms}["actor optimizer"]
    assert optimizer > 0 and "actor optimizer step" not in plain
    assert swapped["actor update"].total == pytest.approx(plain["actor update"].total - optimizer)
    assert "actor optimizer" not in {t.name for t in swapped["generation"].terms}
    step = {t.name: t.bytes for t in swapped["actor optimizer step"].terms}
    actor = _qwen25_32b(*A3_LAYOUT).actor_config
    fullest = max((memory_plan.model_state(actor.arch, actor.parallel, stage, 16, True, True)
                   for stage in range(actor.parallel.pp)), key=lambda state: sum(state.values()))
    assert {k: v for k, v in step.items() if k.startswith("actor")} == {f"actor {k}": v for k, v in fullest.items()}
    assert step["actor optimizer"] >= optimizer and step["reference weights"] > 0


def test_mindspeed_rl_s_own_32b_a3_recipe_fits_as_published():
    path = REFERENCE / "grpo_qwen25_32b_A3.yaml"
    if not path.is_file():
        pytest.skip(f"MindSpeed-RL reference configs not found at {REFERENCE}")
    cfg, _ = load_mindspeed_config(path)
    plans = memory_plan.plan(cfg)
    memory_plan.check(plans, cfg)
    with pytest.raises(ConfigError, match=r"alone need [\d.]+ GiB, the largest actor optimizer"):
        cfg32, _ = load_mindspeed_config(path, ["+rl_config.device_memory_gib=32"])
        memory_plan.check(memory_plan.plan(cfg32), cfg32)


def test_plan_prints_without_devices_and_a_refusal_exits_2(capsys):
    sys.path.insert(0, str(ROOT / "cli"))
    from train_grpo import main

    assert main(["--config-name", "grpo_qwen25_32b", "--plan"]) == 0  # 32 NPUs this machine does not have
    out = capsys.readouterr().out
    assert "memory plan" in out and "actor update:" in out and "generation:" in out
    assert main(["--config-name", "grpo_qwen25_32b", "--plan", *A3_LAYOUT, "+rl_config.device_memory_gib=32"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: the actor devices")


def test_a_device_memory_that_is_not_positive_is_refused():
    with pytest.raises(ConfigError, match=r"rl_config.device_memory_gib must be a positive number"):
        _qwen25_32b("+rl_config.device_memory_gib=0")


def _recipe_rows() -> list[str]:
    rows = []
    for path in sorted(TRAINER_CONFIGS_DIR.glob("*.yaml")):
        cfg = trainer_loader(jobs.stage_of(path.stem))(path.stem)
        for group in memory_plan.plan(cfg):
            peak = group.peak
            state = {t.name: t.bytes for t in peak.terms}
            big, _ = peak.culprit(group.capacity)
            rows.append(f"| {path.stem} | {group.group} | {group.ranks} x {group.kind} of "
                        f"{memory_plan.size(group.capacity)} | {peak.name} | {memory_plan.size(peak.total)} | "
                        f"{big.name} {memory_plan.size(big.bytes)} | "
                        f"{'fits' if group.fits else 'refused'} |")
            assert state
    return rows


def test_the_docs_table_is_each_shipped_recipes_plan():
    """docs/memory_plan.md's table, as the plan computes it today (a CPU recipe's device is this machine's memory
    over its ranks, so those rows are compared without it)."""
    text = (ROOT / "docs/memory_plan.md").read_text()
    documented = [line for line in text.splitlines() if re.match(r"\| \w+ \| [\w+]+ \| \d+ x ", line)]

    def key(row: str) -> str:
        return re.sub(r" of [\d.]+ [MG]iB", "", row) if " x CPU " in row else row

    expected = _recipe_rows()
    assert [key(r) for r in documented] == [key(r) for r in expected], "\n".join(expected)
