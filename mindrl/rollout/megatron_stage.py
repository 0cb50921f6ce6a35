"""One pipeline stage of the actor's GPTModel, run layer by layer with a KV cache.

GPTModel.forward takes megatron-core's StaticInferenceContext, but that path caches keys
before RoPE and re-rotates the whole cached prefix in every layer at every step, expands
grouped KV heads by copying, and places every row at the same positions; on CPU that made
decoding ~2.5x slower than HF transformers' generate. Here every computation is still
done by the actor's own Megatron modules (embedding, norms, the QKV and output projections
with their TP communication, Megatron's RoPE, the MLP and residual adds, the output layer),
and only the attention core differs from training: queries and keys are rotated at each
row's own positions, and the KV writer stores keys and values and attends over the grouped
cache directly (mindrl/rollout/megatron_kv_cache.py). No module of the actor is modified.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer

from mindrl.rollout.megatron_kv_cache import DecodeWriter, PrefillWriter

KVWriter = PrefillWriter | DecodeWriter


class StageForward:
    def __init__(self, model: GPTModel) -> None:
        self.model = model
        self.layers = list(model.decoder.layers)
        for layer in self.layers:
            if not isinstance(layer, TransformerLayer) or not isinstance(layer.cross_attention, IdentityOp):
                raise ValueError("the Megatron rollout engine runs dense decoder-only GPT layers "
                                 f"(pre-norm self-attention and MLP), not {type(layer).__name__}.")
        attention = self.layers[0].self_attention
        self.kv_heads = attention.num_query_groups_per_partition
        self.head_dim = attention.hidden_size_per_attention_head
        self.value_dim = attention.val_hidden_size  # narrower under multi-latent attention
        core = attention.core_attention
        # DotProductAttention divides its scale by the layer number when query-key layer scaling is
        # on and multiplies it back in the softmax; the product is the scale attention applies.
        self.softmax_scale = core.softmax_scale * (core.scale_mask_softmax.scale or 1.0)
        self.first, self.last = model.pre_process, model.post_process
        self.multimodal = getattr(model, "mrope_section", None) is not None
        self._rope = torch.empty(0)

    def __call__(self, inputs: torch.Tensor, positions: torch.Tensor, writer: KVWriter,
                 images: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Token ids [b, s] (first stage) or hidden states [s, b, h] in; hidden states [s, b, h]
        out, or on the last stage the vocab-parallel logits of the last position, [b, vocab / TP].

        `positions` [b, s] are each token's position in its own sequence, or a multimodal-RoPE model's
        [3, b, s] (mindrl.models.vision.mrope_positions; [b, s] then stands for text, the same on every
        axis); `writer` caches the keys and values and computes attention over the cache. `images`
        (pixel_values, image_grid_thw) are the rows' images in row order, for a vision-language first stage.
        """
        model = self.model
        if self.first and images is not None:
            hidden = model.embed_with_images(inputs, *images)
        elif self.first:
            hidden = model.embedding(input_ids=inputs, position_ids=positions)
        else:
            hidden = inputs
        rope = self._rope_at(positions)
        for index, layer in enumerate(self.layers):
            hidden = self._layer(layer, index, hidden, rope, writer)
        if not self.last:
            return hidden
        hidden = model.decoder.final_layernorm(hidden[-1:])
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        logits, _ = model.output_layer(hidden, weight=weight)
        return logits[0]

    def _rope_at(self, positions: torch.Tensor) -> torch.Tensor:
        """Megatron's rotary angles at `positions`, as [s, b, 1, dim] (freshly computed, not
        through RotaryEmbedding.forward's cache, which the training forward reads)."""
        if self.multimodal:
            axes = positions if positions.dim() == 3 else positions.expand(3, *positions.shape)
            return self.model.rotary_pos_emb(axes, self.model.mrope_section)
        needed = int(positions.max()) + 1
        if self._rope.shape[0] < needed:
            self._rope = self.model.rotary_pos_emb.get_emb(max(needed, 2 * self._rope.shape[0]))
        return self._rope[:, 0, 0][positions.t()].unsqueeze(2)

    def _layer(self, layer: TransformerLayer, index: int, hidden: torch.Tensor, rope: torch.Tensor,
               writer: KVWriter) -> torch.Tensor:
        """TransformerLayer.forward for a dense layer, with `_attention` as the attention core."""
        fused = layer.config.bias_dropout_fusion
        attention = self._attention(layer.self_attention, index, layer.input_layernorm(hidden), rope, writer)
        hidden = layer.self_attn_bda(False, fused)(attention, hidden, layer.hidden_dropout)
        mlp = layer.mlp(layer.pre_mlp_layernorm(hidden))
        return layer.mlp_bda(False, fused)(mlp, hidden, layer.hidden_dropout)

    def _attention(self, attention, index: int, hidden: torch.Tensor, rope: torch.Tensor,
                   writer: KVWriter) -> tuple[torch.Tensor, torch.Tensor | None]:
        query, key, value = attention.get_query_key_value_tensors(hidden)  # [s, b, heads, dim]
        query = apply_rotary_pos_emb(query, rope, config=attention.config)
        key = apply_rotary_pos_emb(key, rope, config=attention.config)
        context = writer.attend(index, *(t.permute(1, 2, 0, 3) for t in (query, key, value)), self.softmax_scale)
        seq, batch = hidden.shape[:2]
        return attention.linear_proj(context.permute(2, 0, 1, 3).reshape(seq, batch, -1))
