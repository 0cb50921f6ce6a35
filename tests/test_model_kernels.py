"""mindrl's RMSNorm and SwiGLU modules: torch.nn.RMSNorm's output and gradients, megatron-core's unfused
SwiGLU MLP's output and gradients bit for bit, and both built into every GPTModel."""

import pytest
import torch

from mindrl.config import ParallelConfig, load_model_arch
from mindrl.distributed import init_model_parallel
from mindrl.launch import run_ranks
from mindrl.models import sharding
from mindrl.models.gpt import build_gpt_model, load_stage_weights, transformer_config
from mindrl.models.rmsnorm import RMSNorm, _RMSNorm
from mindrl.models.swiglu import SwiGLU


@pytest.mark.parametrize("shape", [(7, 3, 64), (5, 96), (2, 1, 4, 32)])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rmsnorm_has_torch_rmsnorms_output_and_gradients(shape, dtype, tolerance):
    """The oracle is torch.nn.RMSNorm and autograd through its composite forward; the input and the incoming
    gradient are left as they were (the backward scales a copy in place)."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=gen, dtype=torch.float64)).to(dtype)
    grad = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    reference = torch.nn.RMSNorm(shape[-1], eps=1e-6, dtype=dtype)
    with torch.no_grad():
        reference.weight.copy_(weight)
    x_ref = x.clone().requires_grad_()
    expected = reference(x_ref)
    expected.backward(grad)
    x_ours, weight_ours, grad_in = x.clone().requires_grad_(), weight.clone().requires_grad_(), grad.clone()
    got = _RMSNorm.apply(x_ours, weight_ours, 1e-6)
    got.backward(grad_in)
    assert torch.equal(got, expected)
    for ours, theirs in ((x_ours.grad, x_ref.grad), (weight_ours.grad, reference.weight.grad)):
        assert ours.dtype == theirs.dtype
        diff = (ours.double() - theirs.double()).abs().max().item()
        assert diff <= tolerance * theirs.double().abs().max().item(), f"gradient differs by {diff:.3e}"
    assert torch.equal(x_ours.detach(), x) and torch.equal(grad_in, grad)


def _logits_and_grads(rank: int, dtype: torch.dtype, **overrides) -> tuple[torch.Tensor, dict, set[str]]:
    arch = load_model_arch("tiny_qwen")
    par = ParallelConfig(1, 1)
    init_model_parallel(par, arch=arch)
    model = build_gpt_model(arch, par, dtype, **overrides)
    load_stage_weights(model, sharding.random_full_state_dict(arch, seed=4, dtype=dtype))
    tokens = torch.randint(0, arch.padded_vocab_size, (2, 24), generator=torch.Generator().manual_seed(8))
    positions = torch.arange(24).expand(2, -1)
    logits = model(tokens, positions, None)
    logits.float().square().mean().backward()
    kinds = {f"{type(m).__module__}.{type(m).__name__}" for m in model.modules()}
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}, kinds


def _both_swiglus(rank: int, dtype: torch.dtype) -> list:
    return [_logits_and_grads(rank, dtype), _logits_and_grads(rank, dtype, use_te_activation_func=False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_module_equals_megatron_cores_unfused_mlp_bit_for_bit(dtype):
    """The same model with megatron-core's own activation path (no module: `silu(gate) * (up + offset)`)
    is the oracle: logits and every parameter's gradient equal to the bit."""
    (ours, our_grads, our_kinds), (megatron, megatron_grads, megatron_kinds) = run_ranks(_both_swiglus, 1, dtype)[0]
    assert "mindrl.models.swiglu.SwiGLU" in our_kinds and "mindrl.models.swiglu.SwiGLU" not in megatron_kinds
    # every norm is mindrl's, the final one included, in both models
    assert "mindrl.models.rmsnorm.RMSNorm" in our_kinds and "mindrl.models.rmsnorm.RMSNorm" in megatron_kinds
    assert not any(kind.startswith("torch.nn.modules.normalization") for kind in our_kinds | megatron_kinds)
    assert torch.equal(ours, megatron)
    assert our_grads.keys() == megatron_grads.keys()
    for name, grad in our_grads.items():
        assert torch.equal(grad, megatron_grads[name]), name
    assert max(g.abs().max().item() for g in our_grads.values()) > 0


def test_the_modules_refuse_what_they_do_not_compute():
    arch = load_model_arch("tiny_qwen")
    config = transformer_config(arch, ParallelConfig(1, 1), use_te_activation_func=True)
    config.glu_linear_offset = 1.0
    with pytest.raises(ValueError, match="glu_linear_offset"):
        SwiGLU(config)
    config.glu_linear_offset, config.sequence_parallel = 0.0, True
    # under sequence parallelism (an MoE model at TP > 1) the weight is marked for megatron-core's TP sum
    assert RMSNorm(config, 64).weight.sequence_parallel
    config.layernorm_zero_centered_gamma = True
    with pytest.raises(ValueError, match="zero-centred gamma"):
        RMSNorm(config, 64)
