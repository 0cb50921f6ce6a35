"""The KV cache of one pipeline stage while a batch of responses is generated.

Rows are left-padded and slot-aligned: every prompt ends at slot `prompt_slots - 1` and
response token k of every row sits at slot `prompt_slots + k`, so a decode step writes
one slot of every row with a plain slice, and `valid` (which slots hold a real token)
masks the padding. Keys are stored after RoPE, at each row's own positions, so a decode
step rotates only the new token's query and key instead of the whole cached prefix.
Buffers are [rows, kv_heads, slots, head_dim], the layout scaled_dot_product_attention
reads without copying; the live rows are always a prefix, so dropping finished rows moves
the survivors to the front and the batch shrinks in place.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, layers: int, rows: int, kv_heads: int, slots: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        # Zeros, not empty: attention multiplies masked slots by a zero weight, and 0 × NaN from
        # uninitialised memory would still be NaN.
        shape = (rows, kv_heads, slots, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.valid = torch.zeros(rows, slots, dtype=torch.bool, device=device)
        self.rows = rows

    def keep(self, rows: torch.Tensor, slots: int) -> None:
        """Keep only `rows` (indices into the live rows), moved to the front; the first `slots` slots count."""
        count = rows.numel()
        for buffer in (*self.keys, *self.values):
            buffer[:count, :, :slots] = buffer[rows, :, :slots]
        self.valid[:count, :slots] = self.valid[rows, :slots]
        self.rows = count


class PrefillWriter:
    """Prompt keys/values of a chunk of prompts into the cache rows of their `copies` samples each.

    The samples of a prompt share its prompt, so each prompt is prefilled once; attention
    runs over the chunk's own keys, which are the whole prefix.
    """

    def __init__(self, cache: KVCache, first_row: int, copies: int) -> None:
        self.cache, self.first_row, self.copies = cache, first_row, copies

    def attend_over(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prompts, heads, length, dim = keys.shape
        rows = slice(self.first_row, self.first_row + prompts * self.copies)
        for source, buffer in ((keys, self.cache.keys[layer]), (values, self.cache.values[layer])):
            target = buffer[rows].view(prompts, self.copies, heads, -1, dim)
            target[:, :, :, :length] = source.unsqueeze(1)
        return keys, values


class DecodeWriter:
    """One new token per live row into `slot`; attention runs over the cached slots up to it."""

    def __init__(self, cache: KVCache, slot: int) -> None:
        self.cache, self.slot = cache, slot

    def attend_over(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, end = self.cache.rows, self.slot + 1
        cached_keys = self.cache.keys[layer][:rows]
        cached_values = self.cache.values[layer][:rows]
        cached_keys[:, :, self.slot] = keys[:, :, 0]
        cached_values[:, :, self.slot] = values[:, :, 0]
        return cached_keys[:, :, :end], cached_values[:, :, :end]
