"""Matmul FLOPs of a forward pass (2 per multiply-add): what the benchmarks count, and what picks the
cheaper of two layouts of the same work (mindrl/models/prompt_packing.py)."""

from __future__ import annotations

from mindrl.config import ModelArch


def weight_flops_per_token(arch: ModelArch) -> float:
    """Every weight matrix a token goes through, once: attention and MLP projections of each layer, and the output
    layer (the LM head, or a reward model's or critic's score head). A mixture of experts counts its active
    parameters only: the router, the top-k experts a token goes to and the shared expert (its dense layers, where
    it has them first, their MLP)."""
    h = arch.hidden_size
    outputs = arch.num_labels if arch.has_score_head else arch.padded_vocab_size
    return 2.0 * (sum(_layer_weights(arch.layer_arch(i)) for i in range(arch.num_layers)) + h * outputs)


def _layer_weights(arch: ModelArch) -> float:
    """Multiply-adds of one token through one layer's weights."""
    h, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.query_groups * arch.head_dim
    mlp = 3 * h * arch.ffn_hidden_size
    if arch.is_moe:
        mlp = (h * arch.num_experts + arch.moe_router_topk * 3 * h * arch.expert_ffn_hidden_size
               + 3 * h * (arch.moe_shared_expert_intermediate_size or 0) + h * arch.moe_shared_expert_gate)
    if arch.multi_latent_attention:
        return latent_attention_weights(arch) + mlp
    return h * (q + 2 * kv) + q * h + mlp


def latent_attention_weights(arch: ModelArch) -> float:
    """Multi-latent attention as trained (keys and values expanded from the latent for every token): the query's
    projections, the key-value latent's down and up projections and the output projection; also their parameters."""
    h, heads, latent = arch.hidden_size, arch.num_attention_heads, arch.kv_lora_rank
    query = heads * arch.head_dim
    queries = h * query if arch.q_lora_rank is None else arch.q_lora_rank * (h + query)
    keys_values = h * (latent + arch.qk_pos_emb_head_dim) + latent * heads * (arch.qk_head_dim + arch.v_head_dim)
    return queries + keys_values + heads * arch.v_head_dim * h


def attention_flops_per_key(arch: ModelArch) -> float:
    """QKᵀ and AV for one (query, key) pair, over every layer."""
    return 2.0 * arch.num_layers * arch.num_attention_heads * (arch.head_dim + arch.value_head_dim)


def forward_flops(arch: ModelArch, tokens: float, keys: float) -> float:
    """`tokens` through the weights, and `keys` (query, key) pairs through attention."""
    return weight_flops_per_token(arch) * tokens + attention_flops_per_key(arch) * keys


def vision_flops(arch: ModelArch, grid: tuple[int, int, int]) -> float:
    """One image of patch grid (t, h, w) through a vision-language model's tower: the patch embedding, each
    block's projections (a gated MLP) and its bidirectional attention — within windows of `window_size` pixels, or
    over the whole image in the full-attention blocks — and the merger into the language model's width."""
    vision = arch.vision
    t, h, w = grid
    d, patches = vision.hidden_size, t * h * w
    side = vision.window_size // vision.patch_size  # patches across a window; the last ones may be cut short
    squares = [sum(min(side, n - start) ** 2 for start in range(0, n, side)) for n in (h, w)]
    window_pairs, full_pairs = t * squares[0] * squares[1], patches ** 2
    full_blocks = len(vision.fullatt_block_indexes)
    blocks = vision.depth * 2.0 * patches * (4 * d * d + 3 * d * vision.intermediate_size) + 4.0 * d * (
        full_blocks * full_pairs + (vision.depth - full_blocks) * window_pairs)
    merged, unit = patches // vision.spatial_merge_size ** 2, d * vision.spatial_merge_size ** 2
    return 2.0 * patches * vision.patch_values * d + blocks + 2.0 * merged * unit * (unit + arch.hidden_size)
