"""Rows that share a prompt (GRPO's n samples of it) packed behind one copy of that prompt.

A packed row is [prompt, response 1, …, response k, padding]. Response j's tokens take the RoPE
positions P … P+R_j−1, as if they followed the prompt directly, and attend causally to the prompt
and to their own response only, so every token sees exactly the context it has in its own row —
while the prompt's tokens go through the model once instead of k times. The logits that score each
response's first token are the prompt's last position's, shared by the k responses; every later
response token is scored at its predecessor's position.

Attention stays dense (the local spec has no variable-length kernel), so a packed row of width W
costs W² scores where its k rows cost Σ (P+R_j)²: packing pays while the prompt's share of the
tokens outweighs that, which `packing_pays` judges from the model's shape before each pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mindrl.config import ModelArch
from mindrl.models.flops import forward_flops


@dataclass(frozen=True)
class Packed:
    """One micro-batch's packed rows and where each of its original rows' scores come from."""

    tokens: torch.Tensor  # [G, W]
    position_ids: torch.Tensor  # [G, W]
    attention_mask: torch.Tensor  # [G, 1, W, W] bool, True where attention is masked (Megatron's convention)
    #: [rows, S] flat index into the packed logits ([G·W]) that score tokens[row, t + 1]; −1 off the responses
    source: torch.Tensor


def prompt_groups(tokens: torch.Tensor, prompt_lengths: torch.Tensor) -> list[range]:
    """Runs of consecutive rows with the same prompt (GRPO lays a prompt's samples side by side)."""
    groups: list[range] = []
    start = 0
    for row in range(1, tokens.shape[0] + 1):
        if row == tokens.shape[0] or prompt_lengths[row] != prompt_lengths[start] or \
                not torch.equal(tokens[row, :prompt_lengths[row]], tokens[start, :prompt_lengths[start]]):
            groups.append(range(start, row))
            start = row
    return groups


def packed_width(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, groups: list[range]) -> int:
    return max(int(prompt_lengths[g.start]) + int(response_lengths[g.start:g.stop].sum()) for g in groups)


def pack(tokens: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
         rows: int | None = None, width: int | None = None, groups: list[range] | None = None,
         pad_id: int = 0) -> Packed:
    """Pack right-padded rows [B, S] (prompt then response, lengths given) group by group, into at least
    `rows` packed rows of at least `width` tokens (a pipeline needs every micro-batch the same shape)."""
    groups = prompt_groups(tokens, prompt_lengths) if groups is None else groups
    g_count = max(len(groups), rows or 0)
    w = max(packed_width(prompt_lengths, response_lengths, groups), width or 0)
    packed = torch.full((g_count, w), pad_id, dtype=tokens.dtype, device=tokens.device)
    positions = torch.zeros((g_count, w), dtype=torch.long, device=tokens.device)
    segment = torch.full((g_count, w), -1, dtype=torch.long, device=tokens.device)
    source = torch.full(tokens.shape, -1, dtype=torch.long, device=tokens.device)
    for g, group in enumerate(groups):
        prompt = int(prompt_lengths[group.start])
        packed[g, :prompt] = tokens[group.start, :prompt]
        positions[g, :prompt] = torch.arange(prompt)
        segment[g, :prompt] = 0
        offset = prompt
        for j, row in enumerate(group, start=1):
            length = int(response_lengths[row])
            packed[g, offset:offset + length] = tokens[row, prompt:prompt + length]
            positions[g, offset:offset + length] = torch.arange(prompt, prompt + length)
            segment[g, offset:offset + length] = j
            if length:
                # tokens[row, prompt] is scored at the prompt's last position, the rest at their predecessors'
                source[row, prompt - 1] = g * w + prompt - 1
                source[row, prompt:prompt + length - 1] = g * w + torch.arange(offset, offset + length - 1)
            offset += length
    causal = torch.ones(w, w, dtype=torch.bool, device=tokens.device).tril()
    query, key = segment.unsqueeze(2), segment.unsqueeze(1)
    allowed = causal & ((key == 0) | (key == query)) & (query >= 0)
    allowed |= torch.eye(w, dtype=torch.bool, device=tokens.device)  # padding attends to itself: no empty rows
    return Packed(packed, positions, ~allowed.unsqueeze(1), source)


def packing_pays(arch: ModelArch, plain: tuple[int, int], packed: tuple[int, int]) -> bool:
    """Whether `packed` (rows, width) costs fewer FLOPs than `plain`: every token through the weights, and
    dense attention's width² scores per row, masked or not."""
    def cost(rows: int, width: int) -> float:
        return forward_flops(arch, rows * width, rows * width * width)

    return cost(*packed) < cost(*plain)
