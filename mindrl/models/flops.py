"""Matmul FLOPs of a forward pass (2 per multiply-add): what the benchmarks count, and what picks the
cheaper of two layouts of the same work (mindrl/models/prompt_packing.py)."""

from __future__ import annotations

from mindrl.config import ModelArch


def weight_flops_per_token(arch: ModelArch) -> float:
    """Every weight matrix a token goes through, once: attention and MLP projections of each layer, and the output
    layer (the LM head, or a reward model's or critic's score head). A mixture of experts counts its active
    parameters only: the router, the top-k experts a token goes to and the shared expert."""
    h, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.query_groups * arch.head_dim
    mlp = 3 * h * arch.ffn_hidden_size
    if arch.is_moe:
        mlp = (h * arch.num_experts + arch.moe_router_topk * 3 * h * arch.expert_ffn_hidden_size
               + 3 * h * (arch.moe_shared_expert_intermediate_size or 0) + h * arch.moe_shared_expert_gate)
    layer = h * (q + 2 * kv) + q * h + mlp
    outputs = arch.num_labels if arch.has_score_head else arch.padded_vocab_size
    return 2.0 * (arch.num_layers * layer + h * outputs)


def attention_flops_per_key(arch: ModelArch) -> float:
    """QKᵀ and AV for one (query, key) pair, over every layer."""
    return 4.0 * arch.num_layers * arch.num_attention_heads * arch.head_dim


def forward_flops(arch: ModelArch, tokens: float, keys: float) -> float:
    """`tokens` through the weights, and `keys` (query, key) pairs through attention."""
    return weight_flops_per_token(arch) * tokens + attention_flops_per_key(arch) * keys
