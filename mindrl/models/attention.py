"""The attention core of every mindrl GPTModel: torch's scaled_dot_product_attention, plain or segmented.

megatron-core's local-spec DotProductAttention materialises each [s, s] score matrix, masks it in place
(an autograd copy of the whole matrix) and softmaxes it apart; on CPU that was over half of the small
model's update with packed rows. scaled_dot_product_attention fuses the three (and skips the blocks above
the diagonal of a causal row). A row that packs k responses behind one copy of their prompt
(mindrl/models/prompt_packing.py) is attended segment by segment: the prompt causally over itself, each
response over the prompt and its own earlier tokens — P² + k·R·(P + R) query-key pairs (segments padded
to the batch's longest) where the row as one masked matrix costs (P + k·R)².
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


@dataclass(frozen=True)
class PackedLayout:
    """Where a micro-batch's packed rows [G, W] keep each prompt and response, as indices into Megatron's
    sequence-first activations flattened ([W, G] → t·G + g), and which keys each query may see."""

    prompt_index: torch.Tensor  # [G, P] each group's prompt tokens (0 past the prompt)
    prompt_allowed: torch.Tensor  # [G, 1, P, P] True where query i may attend to key j
    response_index: torch.Tensor  # [G·K, R] each response slot's tokens (0 past the response)
    response_group: torch.Tensor  # [G·K] the group whose prompt each slot follows
    response_allowed: torch.Tensor  # [G·K, 1, R, P + R] over the group's prompt, then the slot's own tokens
    destination: torch.Tensor  # [T] the real tokens: prompts' (row-major over prompt_index), then responses'
    prompt_real: torch.Tensor  # [G, P] True on a prompt's tokens
    response_real: torch.Tensor  # [G·K, R] True on a response's tokens

    def to(self, device: torch.device | str) -> PackedLayout:
        return PackedLayout(*(getattr(self, f.name).to(device) for f in fields(self)))

    def attention_pairs(self) -> int:
        """(query, key) pairs the segmented attention computes, masked ones included."""
        return self.prompt_allowed.numel() + self.response_allowed.numel()


class SDPAttention(DotProductAttention):
    """DotProductAttention's interface and scale (the Megatron rollout engine reads them), computed by
    scaled_dot_product_attention (in bf16 it accumulates the softmax in fp32 itself). `attention_mask` is
    None (causal rows) or a PackedLayout."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.attention_dropout.p or self.config.window_size is not None or self.softmax_offset is not None:
            raise NotImplementedError("mindrl's attention core has no attention dropout, sliding window or "
                                      "softmax offset; these models have none.")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: PackedLayout | None, attn_mask_type=None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        if not (attention_mask is None or isinstance(attention_mask, PackedLayout)):
            raise TypeError(f"mindrl's attention core takes causal rows (no mask) or a PackedLayout, not "
                            f"{type(attention_mask).__name__}.")
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("mindrl's attention core takes no attention bias or packed_seq_params; "
                                      "these models have none.")
        # query-key layer scaling divides softmax_scale by the layer number and the softmax multiplies it back
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        repeat = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)
        seq, batch = query.shape[:2]
        if isinstance(attention_mask, PackedLayout):
            flat = [t.reshape(seq * batch, *t.shape[2:]) for t in (query, key, value)]
            return segmented_attention(*flat, attention_mask, scale).view(seq, batch, -1)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        context = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
        return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)


def segmented_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: PackedLayout,
                        scale: float) -> torch.Tensor:
    """Attention over flat [T, heads, dim] tensors in `layout`'s segments; positions that are no prompt's
    or response's token (padding) get zeros."""
    def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x[index].transpose(-3, -2)  # [N, L, heads, dim] → [N, heads, L, dim]

    prompt_key, prompt_value = take(key, layout.prompt_index), take(value, layout.prompt_index)
    prompt_out = F.scaled_dot_product_attention(take(query, layout.prompt_index), prompt_key, prompt_value,
                                                attn_mask=layout.prompt_allowed, scale=scale)
    slot_key = torch.cat([prompt_key[layout.response_group], take(key, layout.response_index)], dim=2)
    slot_value = torch.cat([prompt_value[layout.response_group], take(value, layout.response_index)], dim=2)
    response_out = F.scaled_dot_product_attention(take(query, layout.response_index), slot_key, slot_value,
                                                  attn_mask=layout.response_allowed, scale=scale)
    real = torch.cat([prompt_out.transpose(1, 2)[layout.prompt_real],
                      response_out.transpose(1, 2)[layout.response_real]])
    return query.new_zeros(query.shape).index_put((layout.destination,), real)
