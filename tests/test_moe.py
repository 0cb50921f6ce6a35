"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, GLM-4.5's DeepSeek-style routing with dense layers first, and
DeepSeek-V3's with multi-latent attention) on megatron-core: HF transformers' logits and gradients at EP=1, TP=2,
EP=2, EP=2×TP=2 and PP=2, and expert-parallel gradients equal EP=1's with the load-balancing loss on (fp32, 4 gloo
ranks, each data-parallel rank on its own rows)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils

from mindrl.config import ConfigError, ModelArch, ParallelConfig, load_model_arch, validate_parallel
from mindrl.distributed import init_model_parallel, release_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import hf_mapping as hfm
from mindrl.models import sharding
from mindrl.models.forward import gather_logits, run_microbatches, token_cross_entropy
from mindrl.models.gpt import build_gpt_model, load_stage_weights
from mindrl.models.optimizer import wrap_for_training, zero_grads
from mindrl.platform import get_platform
from mindrl.rollout.weight_sync import hf_tensors
from tests.hf_models import build_hf_model, checkpoint_state, hf_to_mcore_state, mcore_to_hf_state

KINDS = ("qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3")
#: layers of each kind's tiny model: GLM-4.5's and DeepSeek-V3's keep their first two dense
LAYERS = {"qwen3_moe": 2, "qwen2_moe": 2, "glm4_moe": 4, "deepseek_v3": 4}
LAYOUTS = {
    "ep1": ParallelConfig(1, 1),
    "tp2": ParallelConfig(2, 1),
    "ep2": ParallelConfig(1, 1, expert_model_parallel_size=2),
    "ep2tp2": ParallelConfig(2, 1, expert_model_parallel_size=2),
    "pp2": ParallelConfig(1, 2),
    "ep2pp2": ParallelConfig(1, 2, expert_model_parallel_size=2),
}
ROWS, SEQ, MICRO = 8, 16, 2
#: the expert bias: a weight of the checkpoint that training leaves as it is
FROZEN = "mlp.gate.e_score_correction_bias"
AUX = 0.01


def _run_layout(arch: ModelArch, par: ParallelConfig, full: dict, tokens: torch.Tensor) -> dict:
    """One layout on this rank: its data-parallel rank's rows through DDP (gradients all-reduced over the
    data-parallel and expert-data-parallel groups as in training); logits, losses and gradients back."""
    release_model_parallel()
    moe_utils.get_moe_layer_wise_logging_tracker().clear()  # sized by the first model's layers
    init_model_parallel(par, arch=arch)
    model = build_gpt_model(arch, par)
    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    ep = parallel_state.get_expert_model_parallel_rank()
    load_stage_weights(model, sharding.shard_state_dict(full, arch, par, tp, pp, ep))
    ddp, optimizer = wrap_for_training(model, lr=0.0, use_distributed_optimizer=False)
    zero_grads(ddp, optimizer)
    dp, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    rows = tokens[dp * ROWS // dp_size:(dp + 1) * ROWS // dp_size].to(get_platform().device())
    labels = torch.roll(rows, -1, dims=1)
    captured: list[torch.Tensor] = []

    def loss_fn(logits, batch):
        captured.append(gather_logits(logits).detach().clone())
        return token_cross_entropy(logits, batch)

    run_microbatches(ddp, [{"tokens": rows[i:i + MICRO], "labels": labels[i:i + MICRO]}
                           for i in range(0, rows.shape[0], MICRO)], loss_fn)
    synced = [(name, tensor.cpu()) for name, tensor in hf_tensors(model, arch, par, torch.float32)]
    return {"tp": tp, "pp": pp, "ep": ep, "dp": dp, "synced": synced,
            "logits": torch.cat(captured).cpu() if captured else None,
            # the expert bias is frozen: a weight without a gradient
            "grads": {n: p.main_grad.detach().cpu() if p.requires_grad else torch.zeros_like(p, device="cpu")
                      for n, p in model.named_parameters()}}


def _all_layouts(rank: int, cases: list, layouts: list[ParallelConfig]) -> list:
    return [[_run_layout(arch, par, full, tokens) for par in layouts] for arch, full, tokens, _ in cases]


def _joined(runs: list[dict], arch: ModelArch, par: ParallelConfig) -> tuple[torch.Tensor, dict]:
    """Logits of all rows (each data-parallel rank's, in order) and the full gradients under HF names."""
    last = [r for r in runs if r["logits"] is not None and r["tp"] == 0]
    by_dp = {r["dp"]: r["logits"] for r in last}
    logits = torch.cat([by_dp[d] for d in sorted(by_dp)])[..., :arch.vocab_size_for(1)]
    key = (lambda r: (r["tp"], r["pp"], r["ep"])) if par.ep > 1 else (lambda r: (r["tp"], r["pp"]))
    stages = {key(r): r["grads"] for r in runs}  # gradients are the same on every data-parallel rank
    return logits, mcore_to_hf_state(sharding.merge_state_dicts(stages, arch, par), arch)


def _hf_reference(model, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """HF's logits and the gradient of the mean over micro-batches of their mean token loss."""
    model.zero_grad()
    logits = []
    for i in range(0, ROWS, MICRO):
        rows = tokens[i:i + MICRO]
        out = model(rows).logits
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), torch.roll(rows, -1, dims=1).flatten())
        (loss / (ROWS // MICRO)).backward()
        logits.append(out.detach())
    grads = checkpoint_state(model, {n: p.grad for n, p in model.named_parameters()})
    frozen = [name for name in grads if name.endswith(FROZEN)]  # saved as the buffer's value, not a gradient
    return torch.cat(logits), {name: grad for name, grad in grads.items() if name not in frozen}


def hf_cases() -> tuple[list, dict]:
    """Per kind, the HF model's reference outputs, and the Megatron cases (arch, weights, tokens) without and
    with the load-balancing loss."""
    tokens = torch.randint(0, 250, (ROWS, SEQ), generator=torch.Generator().manual_seed(3))
    cases, expected = [], {}
    for kind in KINDS:
        hf = build_hf_model(kind, seed=7, num_hidden_layers=LAYERS[kind])
        arch = dataclasses.replace(hfm.arch_from_hf_config(hf.config.to_dict(), kind, name=kind),
                                   moe_router_dtype="fp32")
        state = checkpoint_state(hf)
        full = hf_to_mcore_state(state, arch)
        expected[kind] = _hf_reference(hf, tokens)
        # HF's aux loss (over all layers at once) is not Megatron's per-layer one: HF is compared without it,
        # the expert-parallel layouts with it against EP=1
        cases += [(dataclasses.replace(arch, moe_aux_loss_coeff=0.0), full, tokens, state),
                  (dataclasses.replace(arch, moe_aux_loss_coeff=AUX), full, tokens, state)]
    return cases, expected


def run_cases(cases: list, layouts: dict[str, ParallelConfig], world: int, device: str | None = None,
              synced: dict | None = None) -> dict:
    """(kind, aux loss on, layout name) → joined logits and HF-named gradients; into `synced`, the same key →
    every rank's weight-sync tensors. Each kind's two cases run in fresh rank processes: every layout leaves its
    process groups' backend threads behind (megatron-core only forgets its groups), and after a few dozen layouts
    they slowed each rank tenfold."""
    out = {}
    for first in range(0, len(cases), 2):
        per_rank = run_ranks(_all_layouts, world, cases[first:first + 2], list(layouts.values()), device=device)
        for c, (arch, *_) in enumerate(cases[first:first + 2], start=first):
            for i, (name, par) in enumerate(layouts.items()):
                key = (KINDS[c // 2], c % 2 == 1, name)
                out[key] = _joined([ranks[c - first][i] for ranks in per_rank], arch, par)
                if synced is not None:
                    synced[key] = [ranks[c - first][i]["synced"] for ranks in per_rank]
    return out


@pytest.fixture(scope="module")
def results():
    cases, expected = hf_cases()
    synced: dict = {}
    out = run_cases(cases, LAYOUTS, 4, synced=synced)
    states = {KINDS[c // 2]: case[3] for c, case in enumerate(cases)}
    return expected, out, synced, states


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_gradients_equal_hf(results, kind, layout):
    expected, out, _, _ = results
    hf_logits, hf_grads = expected[kind]
    logits, grads = out[(kind, False, layout)]
    assert hf_logits.abs().max() > 1.0
    diff = (logits - hf_logits).abs().max().item()
    print(f"{kind} {layout}: max |logits - HF| = {diff:.2e}")
    assert diff <= 1e-5
    assert {name for name in grads if not name.endswith(FROZEN)} == hf_grads.keys()
    assert all(not grads[name].any() for name in grads if name.endswith(FROZEN))
    for name, grad in hf_grads.items():
        scale = grad.abs().max().item()
        assert scale > 0, f"{name} got no gradient from HF"
        assert (grads[name] - grad).abs().max().item() <= 1e-5 * scale + 1e-8, f"{kind} {layout}: {name}"


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "ep1"])
@pytest.mark.parametrize("kind", KINDS)
def test_expert_parallel_gradients_equal_ep1_with_the_aux_loss(results, kind, layout):
    _, out, _, _ = results
    _, reference = out[(kind, True, "ep1")]
    _, without_aux = out[(kind, False, "ep1")]
    _, grads = out[(kind, True, layout)]
    router = f"model.layers.{LAYERS[kind] // 2 if kind in ('glm4_moe', 'deepseek_v3') else 0}.mlp.gate.weight"
    # the load-balancing loss reaches the router: its gradient is not the one without it
    assert (reference[router] - without_aux[router]).abs().max() > 1e-6
    for name, grad in reference.items():
        assert (grads[name] - grad).abs().max().item() <= 1e-5 * grad.abs().max().item() + 1e-8, f"{layout}: {name}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", KINDS)
def test_the_weight_sync_hands_every_rank_the_hf_checkpoint(results, kind, layout):
    """Experts held by another expert-parallel rank (and stage) reach every rank, in one order, bit-exact."""
    _, _, synced, states = results
    per_rank = synced[(kind, False, layout)]
    names = [name for name, _ in per_rank[0]]
    assert sorted(names) == sorted(states[kind]) and len(names) == len(set(names))
    for tensors in per_rank:
        assert [name for name, _ in tensors] == names
        for name, tensor in tensors:
            assert torch.equal(tensor, states[kind][name]), f"{layout}: {name}"


def test_moe_layouts_that_cannot_be_built_are_one_sentence():
    arch = load_model_arch("tiny_qwen3_moe")
    with pytest.raises(ConfigError, match="expert_model_parallel_size=3 does not divide num_experts=8"):
        validate_parallel(arch, ParallelConfig(1, 1, expert_model_parallel_size=3))
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        validate_parallel(load_model_arch("tiny_qwen"), ParallelConfig(1, 1, expert_model_parallel_size=2))
    with pytest.raises(ConfigError, match="expert_tensor_parallel_size=1 differs from tensor_model_parallel_size=2"):
        validate_parallel(arch, ParallelConfig(2, 1, expert_tensor_parallel_size=1))
    with pytest.raises(ConfigError, match="not divisible by tensor × pipeline × expert parallel size = 2×1×2"):
        validate_parallel(arch, ParallelConfig(2, 1, expert_model_parallel_size=2), world_size=2)
    values = dataclasses.asdict(arch)
    for bad, message in ((dict(moe_router_topk=9), "moe_router_topk=9 must be between 1 and num_experts=8"),
                         (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type='flex' is not one"),
                         (dict(num_experts=None), "is set but num_experts is not")):
        with pytest.raises(ConfigError, match=message):
            ModelArch(**{**values, **bad})


@pytest.mark.parametrize("name, total, active", [("qwen3_30b_a3b", 30.5e9, 3.3e9), ("qwen2_57b_a14b", 57.4e9, 14.2e9),
                                                  ("deepseekv3_671b", 671e9, 37e9)])
def test_shipped_moe_architectures_have_their_published_sizes(name, total, active):
    """Total parameters, and the active ones the benchmarks' FLOPs count (router, top-k experts, shared expert,
    the rest of the layers, both vocabulary matrices) as the model cards give them."""
    import math

    from mindrl.models.flops import weight_flops_per_token

    arch = load_model_arch(name)
    assert sum(math.prod(s) for s in sharding.full_param_shapes(arch).values()) == pytest.approx(total, rel=0.005)
    embedding = arch.hidden_size * arch.padded_vocab_size
    assert weight_flops_per_token(arch) / 2 + embedding == pytest.approx(active, rel=0.02)


GLM45 = dict(model_type="glm4_moe", hidden_act="silu", head_dim=128, num_key_value_heads=8, num_attention_heads=96,
             vocab_size=151552, partial_rotary_factor=0.5, attention_bias=True, tie_word_embeddings=False,
             max_position_embeddings=131072, rope_theta=1000000, norm_topk_prob=True, n_group=1, topk_group=1,
             num_experts_per_tok=8, n_shared_experts=1, num_nextn_predict_layers=0, rms_norm_eps=1e-5)


@pytest.mark.parametrize("config, total, active", [
    (dict(hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
          n_routed_experts=128, first_k_dense_replace=1, routed_scaling_factor=1.0, use_qk_norm=False), 106e9, 12e9),
    (dict(hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=92,
          n_routed_experts=160, first_k_dense_replace=3, routed_scaling_factor=2.5, use_qk_norm=True), 355e9, 32e9),
])
def test_glm45_configs_have_their_published_sizes(config, total, active):
    """GLM-4.5-Air and GLM-4.5 from their published HF configs (MTP layer left out): total parameters, and the active
    ones without the two vocabulary matrices, as the model cards count them (the dense first layers count whole)."""
    import math

    from mindrl.models.flops import weight_flops_per_token

    arch = hfm.arch_from_hf_config({**GLM45, **config}, "glm4_moe")
    assert sum(math.prod(s) for s in sharding.full_param_shapes(arch).values()) == pytest.approx(total, rel=0.01)
    vocab = arch.hidden_size * arch.padded_vocab_size
    assert weight_flops_per_token(arch) / 2 - vocab == pytest.approx(active, rel=0.02)


def test_flops_count_dense_first_layers_and_active_experts_by_hand():
    arch = hfm.arch_from_hf_config(build_hf_model("glm4_moe", num_hidden_layers=4).config.to_dict(), "glm4_moe")
    from mindrl.models.flops import weight_flops_per_token

    attention = 64 * (4 * 32 + 2 * 2 * 32) + 4 * 32 * 64  # fused QKV in, output projection
    dense = attention + 3 * 64 * 96  # layers 0 and 1: SwiGLU of width 96
    moe = attention + 64 * 8 + 2 * 3 * 64 * 32 + 3 * 64 * 32  # router, top-2 experts of 32, shared expert of 32
    assert weight_flops_per_token(arch) == 2 * (2 * dense + 2 * moe + 64 * 256)


def test_flops_count_multi_latent_attention_by_hand():
    """DeepSeek-V3's tiny model: hidden 64, 4 heads with 16 + 8 query/key and 12 value dimensions, latents of 32
    (queries) and 16 (keys and values)."""
    from mindrl.models.flops import attention_flops_per_key, weight_flops_per_token

    arch = hfm.arch_from_hf_config(build_hf_model("deepseek_v3", num_hidden_layers=4).config.to_dict(), "deepseek_v3")
    attention = 64 * 32 + 32 * 4 * 24 + 64 * (16 + 8) + 16 * 4 * (16 + 12) + 4 * 12 * 64
    dense = attention + 3 * 64 * 96
    moe = attention + 64 * 8 + 2 * 3 * 64 * 32 + 3 * 64 * 32
    assert weight_flops_per_token(arch) == 2 * (2 * dense + 2 * moe + 64 * 256)
    assert attention_flops_per_key(arch) == 2 * 4 * 4 * (24 + 12)  # QKᵀ over 24 dimensions, AV over 12


def test_each_routing_part_changes_glm45s_logits():
    """The HF parity above could not hold by accident: without any one of the expert bias, the groups or the routing
    scale, HF's own logits move by far more than its tolerance."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    hf = build_hf_model("glm4_moe", seed=7, num_hidden_layers=4)
    tokens = torch.randint(0, 250, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = hf(tokens).logits
        routers = [m for m in hf.modules() if isinstance(m, Glm4MoeTopkRouter)]
        for part, value in (("e_score_correction_bias", 0.0), ("num_group", 1), ("routed_scaling_factor", 1.0)):
            saved = [torch.clone(getattr(r, part)) if part == "e_score_correction_bias" else getattr(r, part)
                     for r in routers]
            for router in routers:
                if part == "e_score_correction_bias":
                    router.e_score_correction_bias.zero_()
                else:
                    setattr(router, part, value)
            assert (hf(tokens).logits - reference).abs().max() > 1e-3, part
            for router, old in zip(routers, saved, strict=True):
                if part == "e_score_correction_bias":
                    router.e_score_correction_bias.copy_(old)
                else:
                    setattr(router, part, old)
        assert torch.equal(hf(tokens).logits, reference)
