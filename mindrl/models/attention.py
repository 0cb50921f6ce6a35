"""The attention core of every mindrl GPTModel: torch's scaled_dot_product_attention, plain or segmented.

megatron-core's local-spec DotProductAttention materialises each [s, s] score matrix, masks it in place
(an autograd copy of the whole matrix) and softmaxes it apart; on CPU that was over half of the small
model's update with packed rows. scaled_dot_product_attention fuses the three (and skips the blocks above
the diagonal of a causal row). A row that packs k responses behind one copy of their prompt
(mindrl/models/prompt_packing.py) is attended segment by segment: the prompt causally over itself, each
response over the prompt and its own earlier tokens — P² + k·R·(P + R) query-key pairs (segments padded
to the batch's longest) where the row as one masked matrix costs (P + k·R)². A padding-free packed sequence
(mindrl/models/micro_batches.py) is attended sample by sample, each in its own shape (`Segments`).

On CPU a segment whose score matrix is small is computed as Megatron's unfused core does it: two batched
matmuls with a softmax between them. torch's CPU flash kernel runs these head_dim-64 segments far below the
matmul rate: the small model's response segments for one micro-batch of 16 (bf16, forward + backward)
take it 66 ms, the matmuls 18 ms. Large segments, fp16 ones, and every segment on an accelerator keep the
fused kernel, which never holds the score matrix.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

from mindrl.models.recompute import recomputes_core
from mindrl.platform import get_platform


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
    prompt_rows: torch.Tensor  # the prompts' real tokens as flat positions in prompt_index ([G·P]), in order
    response_rows: torch.Tensor  # the responses' real tokens as flat positions in response_index ([G·K·R])

    def to(self, device: torch.device | str) -> PackedLayout:
        return PackedLayout(*(getattr(self, f.name).to(device) for f in fields(self)))

    def attention_pairs(self) -> int:
        """(query, key) pairs the segmented attention computes, masked ones included."""
        return self.prompt_allowed.numel() + self.response_allowed.numel()


@dataclass(frozen=True)
class Segments:
    """The samples of a padding-free packed sequence [T] (mindrl/models/micro_batches.py): each query segment
    attends causally to its own tokens and, in full, to the keys of its prefix before them (the prompt a
    response shares with its group's other samples; length 0 for none). Tokens past the last segment are
    padding and get zeros."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    prefixes: tuple[tuple[int, int], ...]  # (start, length) of each segment's prefix keys

    def to(self, device: torch.device | str) -> Segments:
        return self  # plain offsets: the attention slices by them


class SplitSequence(ABC):
    """A padding-free packed sequence cut over ranks (mindrl/models/context_parallel.py): its own attention joins
    the ranks' shares."""

    @abstractmethod
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               enable_gqa: bool) -> torch.Tensor:
        """This rank's attention output for its share of the queries [length, heads, dim]."""


class SDPAttention(DotProductAttention):
    """DotProductAttention's interface and scale (the Megatron rollout engine reads them), computed by
    scaled_dot_product_attention (in bf16 it accumulates the softmax in fp32 itself; small packed segments on
    CPU by matmuls, see the module's docstring). `attention_mask` is None (causal rows), a PackedLayout (rows
    packed behind shared prompts), Segments (one padding-free packed sequence) or a SplitSequence (one cut over
    context-parallel ranks)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.attention_dropout.p or self.config.window_size is not None or self.softmax_offset is not None:
            raise NotImplementedError("mindrl's attention core has no attention dropout, sliding window or "
                                      "softmax offset; these models have none.")
        self.enable_gqa = get_platform().sdpa_enable_gqa

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: PackedLayout | None, attn_mask_type=None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        if not (attention_mask is None or isinstance(attention_mask, (PackedLayout, Segments, SplitSequence))):
            raise TypeError(f"mindrl's attention core takes causal rows (no mask), a PackedLayout, Segments or a "
                            f"SplitSequence, not {type(attention_mask).__name__}.")
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("mindrl's attention core takes no attention bias or packed_seq_params; "
                                      "these models have none.")
        if torch.is_grad_enabled():
            # the values are a view of the fused QKV projection's output: what the backward keeps of them would
            # hold all of it alive, the queries' and keys' columns included
            value = own_storage(value)
        if recomputes_core(self.config) and self.training and torch.is_grad_enabled():
            return checkpoint(self._core, query, key, value, attention_mask, use_reentrant=False)
        return self._core(query, key, value, attention_mask)

    def _core(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: PackedLayout | Segments | SplitSequence | None) -> torch.Tensor:
        # query-key layer scaling divides softmax_scale by the layer number and the softmax multiplies it back
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        seq, batch = query.shape[:2]
        if isinstance(attention_mask, PackedLayout):
            flat = [t.reshape(seq * batch, *t.shape[2:]) for t in (query, key, value)]
            return segmented_attention(*flat, attention_mask, scale, self.enable_gqa).view(seq, batch, -1)
        if isinstance(attention_mask, (Segments, SplitSequence)):
            if batch != 1:
                raise ValueError(f"a padding-free packed micro-batch is one sequence, but this one has {batch} rows.")
            flat = [t.squeeze(1) for t in (query, key, value)]
            if isinstance(attention_mask, SplitSequence):
                return attention_mask.attend(*flat, scale, self.enable_gqa).reshape(seq, 1, -1)
            return packed_attention(*flat, attention_mask, scale, self.enable_gqa).view(seq, 1, -1)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        context = _sdpa(query, key, value, self.enable_gqa, is_causal=True, scale=scale)
        return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)


#: score elements per row (on this TP rank's heads) above which a CPU segment keeps the fused kernel: the
#: backward keeps every row's probabilities per layer, so a micro-batch of N rows holds N times this many
MATERIALISE_MAX = 1 << 22


def segmented_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: PackedLayout,
                        scale: float, enable_gqa: bool = False) -> torch.Tensor:
    """Attention over flat [T, heads, dim] queries and [T, groups, dim] keys and values in `layout`'s
    segments; positions that are no prompt's or response's token (padding) get zeros."""
    # whole rows are gathered and scattered by index_select / index_copy: advanced indexing runs torch's
    # element-wise index kernel (and accumulating index_put in the backward), 4-12x slower on CPU here
    def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        rows = x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])
        return rows.transpose(-3, -2)  # [N, L, heads, dim] → [N, heads, L, dim]

    def real(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        n, heads, length, dim = out.shape
        return out.transpose(1, 2).reshape(n * length, heads, dim).index_select(0, rows)

    prompt_key, prompt_value = take(key, layout.prompt_index), take(value, layout.prompt_index)
    prompt_out = _attend(take(query, layout.prompt_index), prompt_key, prompt_value, layout.prompt_allowed,
                         scale, enable_gqa)
    slot_key = torch.cat([prompt_key.index_select(0, layout.response_group), take(key, layout.response_index)],
                         dim=2)
    slot_value = torch.cat([prompt_value.index_select(0, layout.response_group),
                            take(value, layout.response_index)], dim=2)
    response_out = _attend(take(query, layout.response_index), slot_key, slot_value, layout.response_allowed,
                           scale, enable_gqa)
    rows = torch.cat([real(prompt_out, layout.prompt_rows), real(response_out, layout.response_rows)])
    return query.new_zeros((*query.shape[:-1], value.shape[-1])).index_copy(0, layout.destination, rows)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Segments,
                     scale: float, enable_gqa: bool = False) -> torch.Tensor:
    """Attention over a padding-free packed sequence: [T, heads, dim] queries, [T, groups, dim] keys and values,
    sample by sample (each its own shapes: nothing is padded to the longest sample)."""
    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).unsqueeze(0)  # [L, heads, dim] → [1, heads, L, dim]

    pieces = []
    for start, length, (first, prefix) in zip(segments.starts, segments.lengths, segments.prefixes, strict=True):
        own = slice(start, start + length)
        keys, values = key[own], value[own]
        if prefix:
            keys = torch.cat([key[first:first + prefix], keys])
            values = torch.cat([value[first:first + prefix], values])
        else:  # a slice the backward kept would keep the whole sequence's keys and values
            keys, values = own_storage(keys), own_storage(values)
        out = _causal(heads_first(query[own]), heads_first(keys), heads_first(values), prefix, scale, enable_gqa,
                      heads_first(query[first:first + prefix]))
        pieces.append(out.squeeze(0).transpose(0, 1))
    end = segments.starts[-1] + segments.lengths[-1] if segments.starts else 0
    pieces.append(query.new_zeros((query.shape[0] - end, query.shape[1], value.shape[-1])))
    return torch.cat(pieces)


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied where it is a view into a larger storage (the backward keeps storages, not views)."""
    if tensor.requires_grad and tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


def _causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix: int, scale: float,
            enable_gqa: bool, prefix_query: torch.Tensor) -> torch.Tensor:
    """[1, heads, L, dim] queries over [1, groups, prefix + L, dim] keys: every prefix key, then causally
    (`prefix_query`: the prefix's own [1, heads, prefix, dim] queries)."""
    length = query.shape[2]
    if not _materialised(query, key.shape[2]):
        if not prefix:
            return _sdpa(query, key, value, enable_gqa, is_causal=True, scale=scale)
        if query.device.type == "cpu":
            # torch's CPU kernels turn a causal mask aligned to the last key into dense fp32 [L, prefix + L] masks
            # that the backward keeps, two a layer (quadratic in the length); with the prefix's own queries in
            # front it is the plain causal case, for prefix more query rows
            whole = torch.cat([prefix_query, query], dim=2)
            return _sdpa(whole, key, value, enable_gqa, is_causal=True, scale=scale)[:, :, prefix:]
        # causal aligned to the last key: the accelerators' fused kernels take it without a dense mask
        return _sdpa(query, key, value, enable_gqa, attn_mask=causal_lower_right(length, prefix + length),
                     scale=scale)
    allowed = torch.ones(length, prefix + length, dtype=torch.bool, device=query.device).tril(prefix)
    return _attend(query, key, value, allowed[None, None], scale, enable_gqa)


def _materialised(query: torch.Tensor, keys: int) -> bool:
    """Whether this CPU segment's score matrix is small enough to compute by matmuls (the module's docstring);
    fp16 scores could overflow to inf before the softmax, where the fused kernel accumulates in fp32."""
    heads, length = query.shape[1:3]
    return (query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16)
            and heads * length * keys <= MATERIALISE_MAX)


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
            scale: float, enable_gqa: bool) -> torch.Tensor:
    """softmax(q·kᵀ·scale where allowed)·v for [N, heads, L, dim] queries over [N, groups, S, dim] keys; for
    fixed segment shapes a row's result does not depend on N (tested on CPU)."""
    n, heads, length, dim = query.shape
    groups, keys = key.shape[1], key.shape[2]
    per_group = heads // groups
    if not _materialised(query, keys):
        return _sdpa(query, key, value, enable_gqa, attn_mask=allowed, scale=scale)
    # the heads of a query group share its keys: one [heads/groups · L, S] score matrix per group, the mask
    # added by the matmul itself; scores round to the activations' dtype, as in Megatron's unfused core
    bias = torch.zeros_like(allowed, dtype=query.dtype).masked_fill_(~allowed, float("-inf"))
    bias = bias.unsqueeze(1).expand(n, groups, per_group, length, keys).reshape(n * groups, -1, keys)
    scores = torch.baddbmm(bias, query.reshape(n * groups, per_group * length, dim),
                           key.reshape(n * groups, keys, dim).transpose(1, 2), alpha=scale)
    width = value.shape[-1]  # multi-latent attention's values are narrower than its queries and keys
    return (scores.softmax(-1) @ value.reshape(n * groups, keys, width)).view(n, heads, length, width)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool,
          **kwargs: object) -> torch.Tensor:
    """torch's fused attention of [b, heads, s, dim] queries over [b, groups, s, dim] keys and [b, groups, s, value
    dim] values: given the groups where the platform's kernels take them (`enable_gqa`), else with each group's K/V
    repeated for its heads."""
    width = value.shape[-1]
    if query.device.type == "cpu" and width < query.shape[-1]:
        # multi-latent attention's narrower values: torch's CPU flash kernel takes one head size, and without it
        # scaled_dot_product_attention falls back to its math kernel, which keeps each [L, S] score matrix for the
        # backward (quadratic in the length). Zero columns change no score and no other output column.
        padded = F.pad(value, (0, query.shape[-1] - width))
        return _sdpa(query, key, padded, enable_gqa, **kwargs)[..., :width]
    per_group = query.shape[1] // key.shape[1]
    if enable_gqa or per_group == 1:
        return F.scaled_dot_product_attention(query, key, value, enable_gqa=per_group > 1, **kwargs)
    key, value = key.repeat_interleave(per_group, dim=1), value.repeat_interleave(per_group, dim=1)
    return F.scaled_dot_product_attention(query, key, value, **kwargs)
