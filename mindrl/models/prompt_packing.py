"""Rows that share a prompt (GRPO's n samples of it) packed behind one copy of that prompt.

A packed row is [prompt, response 1, …, response k, padding]. Response j's tokens take the RoPE
positions P … P+R_j−1, as if they followed the prompt directly, and attend causally to the prompt
and to their own response only, so every token sees exactly the context it has in its own row —
while the prompt's tokens go through the model once instead of k times. The logits that score each
response's first token are the prompt's last position's, shared by the k responses; every later
response token is scored at its predecessor's position.

The attention core runs such rows segment by segment (mindrl/models/attention.py): each prompt over
itself, each response over its prompt and itself, padded to the longest prompt and response.
`packing_pays` weighs that against the plain rows before each pass: with one sample per
prompt, or prompts cut apart by the micro-batches, packing saves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mindrl.config import ModelArch
from mindrl.models.attention import PackedLayout
from mindrl.models.flops import forward_flops


@dataclass(frozen=True)
class Packed:
    """One micro-batch's packed rows and where each of its original rows' scores come from."""

    tokens: torch.Tensor  # [G, W]
    position_ids: torch.Tensor  # [G, W]
    layout: PackedLayout  # the attention core's map of the rows' prompts and responses
    #: [rows, S] flat index into the packed logits ([G·W]) that score tokens[row, t + 1]; −1 off the responses
    source: torch.Tensor
    #: [G] tokens of each packed row before its padding (its prompt and responses)
    lengths: torch.Tensor


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
         pad_id: int = 0, segments: tuple[int, int] = (1, 1)) -> Packed:
    """Pack right-padded rows [B, S] (prompt then response, lengths given) group by group, into at least
    `rows` packed rows of at least `width` tokens (a pipeline needs every micro-batch the same shape).

    The attention layout pads prompts and responses to at least `segments` (prompt, response) tokens:
    given the whole batch's longest, every micro-batch attends in the same shapes, so a row's scores do
    not depend on which rows share its micro-batch (the attention kernel's blocking follows the shapes)
    and a reference and an actor cutting the batch differently agree to the bit on CPU (tested)."""
    groups = prompt_groups(tokens, prompt_lengths) if groups is None else groups
    g_count = max(len(groups), rows or 0)
    w = max(packed_width(prompt_lengths, response_lengths, groups), width or 0)
    packed = torch.full((g_count, w), pad_id, dtype=tokens.dtype, device=tokens.device)
    positions = torch.zeros((g_count, w), dtype=torch.long, device=tokens.device)
    source = torch.full(tokens.shape, -1, dtype=torch.long, device=tokens.device)
    slots = max(map(len, groups))
    prompt_lengths_of = torch.zeros(g_count, dtype=torch.long)
    slot_lengths = torch.zeros(g_count * slots, dtype=torch.long)
    prompt_index = torch.zeros((g_count, max(int(prompt_lengths.max()), segments[0])), dtype=torch.long)
    response_index = torch.zeros((g_count * slots, max(int(response_lengths.max()), segments[1])),
                                 dtype=torch.long)
    for g, group in enumerate(groups):
        prompt = int(prompt_lengths[group.start])
        packed[g, :prompt] = tokens[group.start, :prompt]
        positions[g, :prompt] = torch.arange(prompt)
        prompt_lengths_of[g] = prompt
        prompt_index[g, :prompt] = torch.arange(prompt) * g_count + g  # Megatron's [W, G] flattened
        offset = prompt
        for j, row in enumerate(group):
            length = int(response_lengths[row])
            packed[g, offset:offset + length] = tokens[row, prompt:prompt + length]
            positions[g, offset:offset + length] = torch.arange(prompt, prompt + length)
            slot_lengths[g * slots + j] = length
            response_index[g * slots + j, :length] = torch.arange(offset, offset + length) * g_count + g
            if length:
                # tokens[row, prompt] is scored at the prompt's last position, the rest at their predecessors'
                source[row, prompt - 1] = g * w + prompt - 1
                source[row, prompt:prompt + length - 1] = g * w + torch.arange(offset, offset + length - 1)
            offset += length
    layout = _layout(prompt_index, prompt_lengths_of, response_index, slot_lengths, slots)
    lengths = prompt_lengths_of + slot_lengths.view(g_count, slots).sum(dim=1)
    return Packed(packed, positions, layout.to(tokens.device), source, lengths)


def _layout(prompt_index: torch.Tensor, prompt_lengths: torch.Tensor, response_index: torch.Tensor,
            slot_lengths: torch.Tensor, slots: int) -> PackedLayout:
    """Every query sees its own segment causally and a response's also its whole prompt; a padding query
    sees at least its prompt's first key (or a padding row's), so no softmax row is empty."""
    p, r = prompt_index.shape[1], response_index.shape[1]
    group = torch.arange(prompt_index.shape[0]).repeat_interleave(slots)
    prompt_real = torch.arange(p) < prompt_lengths.unsqueeze(1)
    response_real = torch.arange(r) < slot_lengths.unsqueeze(1)
    visible_prompt = torch.arange(p) < prompt_lengths.clamp(min=1).unsqueeze(1)  # [G, P] keys
    prompt_allowed = torch.ones(p, p, dtype=torch.bool).tril() & visible_prompt.unsqueeze(1)
    own = torch.ones(r, r, dtype=torch.bool).tril() & response_real.unsqueeze(1)
    response_allowed = torch.cat([visible_prompt[group].unsqueeze(1).expand(-1, r, -1), own], dim=2)
    # found once here, not in every layer's attention
    prompt_rows, response_rows = (real.reshape(-1).nonzero().squeeze(1) for real in (prompt_real, response_real))
    destination = torch.cat([prompt_index.reshape(-1)[prompt_rows], response_index.reshape(-1)[response_rows]])
    return PackedLayout(prompt_index, prompt_allowed.unsqueeze(1), response_index, group,
                        response_allowed.unsqueeze(1), destination, prompt_rows, response_rows)


def packing_pays(arch: ModelArch, plain: tuple[int, int], packed: list[Packed]) -> bool:
    """Whether the `packed` micro-batches cost fewer FLOPs than as many plain ones of shape `plain`
    (rows, width): every token through the weights, causal attention over each plain row, and every
    (query, key) pair the segmented attention computes, masked or not."""
    rows, width = plain
    plain_cost = len(packed) * forward_flops(arch, rows * width, rows * width * (width + 1) / 2)
    packed_cost = sum(forward_flops(arch, mb.tokens.numel(), mb.layout.attention_pairs()) for mb in packed)
    return packed_cost < plain_cost
