"""The segmented attention core's CPU matmul path against torch's fused kernel: outputs and the gradients
of queries, keys and values, with grouped-query heads and padded segments; a padding-free packed sequence
against one dense masked attention."""

import pytest
import torch

from mindrl.models import attention
from mindrl.models.prompt_packing import pack
from tests.test_prompt_packing import grouped_batch

HEADS, GROUPS, DIM = 4, 2, 8


def _outputs_and_grads(dtype: torch.dtype, seed: int = 0, enable_gqa: bool = False) -> tuple[list[torch.Tensor], int]:
    """Outputs and q/k/v gradients, and how many batched matmuls with a mask (the CPU path) ran."""
    batch = grouped_batch(50)
    packed = pack(batch["tokens"], batch["prompt_lengths"], batch["response_lengths"], segments=(10, 9))
    flat = packed.tokens.numel()
    gen = torch.Generator().manual_seed(seed)
    query, key, value = (torch.randn(flat, heads, DIM, generator=gen).to(dtype).requires_grad_()
                         for heads in (HEADS, GROUPS, GROUPS))
    calls = []
    baddbmm = torch.baddbmm

    def counted(*args, **kwargs):
        calls.append(1)
        return baddbmm(*args, **kwargs)

    torch.baddbmm = counted
    try:
        out = attention.segmented_attention(query, key, value, packed.layout, DIM ** -0.5, enable_gqa)
    finally:
        torch.baddbmm = baddbmm
    out.backward(torch.randn(out.shape, generator=gen).to(dtype))
    return [out.detach(), query.grad, key.grad, value.grad], len(calls)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 3e-2)])
def test_the_fused_kernel_given_the_query_groups_equals_it_given_repeated_keys(monkeypatch, dtype, tolerance):
    """Where the platform's kernels take grouped-query attention as it is (CUDA), only the K/V copy goes (and the
    order in which a group's heads add up their key and value gradients)."""
    monkeypatch.setattr(attention, "MATERIALISE_MAX", 0)
    repeated, _ = _outputs_and_grads(dtype, enable_gqa=False)
    grouped, _ = _outputs_and_grads(dtype, enable_gqa=True)
    for name, mine, oracle in zip(("output", "query grad", "key grad", "value grad"), grouped, repeated, strict=True):
        assert (mine.float() - oracle.float()).abs().max().item() <= tolerance * oracle.float().abs().max().item(), name
    gen = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(2, heads, 12, DIM, generator=gen).to(dtype) for heads in (HEADS, GROUPS, GROUPS))
    causal = [attention._sdpa(query, key, value, gqa, is_causal=True).float() for gqa in (True, False)]
    assert (causal[0] - causal[1]).abs().max().item() <= tolerance * causal[1].abs().max().item()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 3e-2)])
def test_the_cpu_matmul_path_has_the_fused_kernels_outputs_and_gradients(monkeypatch, dtype, tolerance):
    matmuls, masked_matmuls = _outputs_and_grads(dtype)
    monkeypatch.setattr(attention, "MATERIALISE_MAX", 0)
    fused, none = _outputs_and_grads(dtype)
    assert (masked_matmuls, none) == (2, 0)  # the prompt and the response segments; then the fused kernel
    for name, mine, oracle in zip(("output", "query grad", "key grad", "value grad"), matmuls, fused, strict=True):
        assert torch.isfinite(mine).all(), name
        assert (mine.float() - oracle.float()).abs().max().item() <= tolerance * oracle.float().abs().max().item(), name


@pytest.mark.parametrize("response", [40, 1100], ids=["matmuls", "fused kernel"])
def test_a_padding_free_sequence_attends_each_sample_to_its_prompt_and_itself(response):
    """Segments: a shared prompt of 300 tokens, two responses behind it and an unrelated sample, then padding;
    against one dense masked attention over the whole sequence. Long responses take the fused kernel with a causal
    mask aligned to the last key (no dense mask built), short ones the CPU matmul path."""
    prompt, other, pad = 300, 50, 6
    starts = (0, prompt, prompt + response, prompt + 2 * response)
    lengths = (prompt, response, response, other)
    prefixes = ((0, 0), (0, prompt), (0, prompt), (starts[3], 0))
    total = starts[3] + other + pad
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(total, HEADS, DIM, generator=gen)
    key, value = (torch.randn(total, GROUPS, DIM, generator=gen) for _ in range(2))
    out = attention.packed_attention(query, key, value, attention.Segments(starts, lengths, prefixes), 0.3, True)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for start, length, (first, prefix) in zip(starts, lengths, prefixes, strict=True):
        own = slice(start, start + length)
        allowed[own, first:first + prefix] = True
        allowed[own, own] = torch.ones(length, length, dtype=torch.bool).tril()
    allowed[total - pad:, 0] = True  # padding queries: any key (their outputs are zeroed below)
    heads_first = [x.repeat_interleave(HEADS // x.shape[1], 1).transpose(0, 1) for x in (query, key, value)]
    dense = torch.nn.functional.scaled_dot_product_attention(*heads_first, attn_mask=allowed, scale=0.3).transpose(0, 1)
    dense[total - pad:] = 0
    assert (out - dense).abs().max().item() < 1e-5


def test_a_long_sample_behind_a_shared_prompt_keeps_nothing_quadratic_for_the_backward():
    """torch's CPU kernels build a causal mask aligned to the last key as dense fp32 [L, prompt + L] tensors that
    the backward keeps (two a layer); the prompt's queries in front make it the plain causal case. Gradients
    against the dense masked attention too."""
    prompt, response = 64, 1500
    starts, lengths, prefixes = (0, prompt), (prompt, response), ((0, 0), (0, prompt))
    gen = torch.Generator().manual_seed(2)
    total = prompt + response
    query = torch.randn(total, HEADS, DIM, generator=gen, requires_grad=True)
    key, value = (torch.randn(total, GROUPS, DIM, generator=gen, requires_grad=True) for _ in range(2))
    weights = torch.randn(total, HEADS, DIM, generator=gen)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
        out = attention.packed_attention(query, key, value, attention.Segments(starts, lengths, prefixes), 0.3, True)
    assert max(kept) < response * (prompt + response) / 4
    mine = torch.autograd.grad((out * weights).sum(), (query, key, value))
    allowed = torch.ones(total, total, dtype=torch.bool).tril()
    heads_first = [x.repeat_interleave(HEADS // x.shape[1], 1).transpose(0, 1) for x in (query, key, value)]
    dense = torch.nn.functional.scaled_dot_product_attention(*heads_first, attn_mask=allowed, scale=0.3).transpose(0, 1)
    oracle = torch.autograd.grad((dense * weights).sum(), (query, key, value))
    for name, a, b in zip(("output", "query", "key", "value"), (out, *mine), (dense, *oracle), strict=True):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item(), name


@pytest.mark.parametrize("enable_gqa", [True, False], ids=["groups", "repeated"])
def test_the_backward_keeps_nothing_of_the_qkv_projections_output(enable_gqa):
    """Values are a view of the fused QKV projection's output (the rotated queries and keys are tensors of their
    own); a segment's slice that the backward kept would keep that whole output alive, every other segment's rows
    and the queries' and keys' columns included."""
    length = 1200
    mixed = torch.randn(2 * length, HEADS + 2 * GROUPS, DIM, requires_grad=True)
    query, key, value = mixed.split([HEADS, GROUPS, GROUPS], dim=1)
    query, key = query * 1.0, key * 1.0  # as rotary embedding gives them
    segments = attention.Segments((0, length), (length, length), ((0, 0), (length, 0)))
    kept = set()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.add(t.untyped_storage().data_ptr()) or t,
                                                  lambda t: t):
        attention.packed_attention(query, key, value, segments, 0.3, enable_gqa)
    assert kept and mixed.untyped_storage().data_ptr() not in kept
