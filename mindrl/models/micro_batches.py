"""How a pass's rows become padding-free micro-batches, cut by a row count or by a token budget.

Reasoning RL's responses are long-tailed: padded to the batch's longest, most of a pass's FLOPs and activations
go to padding, and one long response sets every micro-batch's peak. With `remove_padding` the rows of a
micro-batch are concatenated into one sequence [1, T] (Megatron's THD layout), each sample attending only to
itself (mindrl.models.attention.Segments) with its RoPE positions restarting at 0. Rows that share a prompt
(GRPO's n samples side by side) keep one copy of it in the sequence: each response attends to that copy and to
its own tokens, as mindrl/models/prompt_packing.py does for padded rows, so the prompt's tokens go through the
model once. Without padding this always saves work, so it is done wherever it applies (`prompt_packing: off`
turns it off).

A token budget (`max_tokens`, MindSpeed-RL's use_dynamic_bsz with *_max_packing_token_size) cuts the rows in
order into micro-batches of at most that many packed tokens (and `max_rows` rows): consecutive rows keep a
prompt's samples together and the results in the rows' order. A sample longer than the budget goes alone into
its micro-batch: MindSpeed-RL's published 20k recipe leaves the reference's budget (4096) below its longest
samples and runs, so refusing would break it; the peak of that pass is then the longest sample's, which the
trainer says at start. A budget below the longest prompt is refused before Ray starts (a prompt is never cut).

The loss never sees the packed sequence: every per-token tensor of the pass stays in its plain [rows, S] layout
and `source` names the packed position whose logits score each plain token, so the loss normalisation of every
`loss_agg_mode` (mini-batch totals, mindrl.algorithms.aggregation) does not depend on the cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mindrl.config.batching import Batching
from mindrl.models.attention import Segments


@dataclass(frozen=True)
class PackedRows:
    """One micro-batch's rows as a padding-free sequence."""

    tokens: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    segments: Segments  # which keys each packed token attends to
    #: [rows, S] where tokens[row, t] is in the packed sequence (its logits score tokens[row, t + 1]), for every
    #: token from the prompt's last on (from the first where no prompt length is given); −1 elsewhere
    source: torch.Tensor
    #: [T] flat index into the plain rows ([rows · S]) each packed token comes from (0 for padding)
    origin: torch.Tensor
    #: tokens before the padding
    real: int
    #: whether some rows share one copy of their prompt
    shared: bool


def cut(lengths: list[int], prompts: list[int] | None, groups: list[range], size: int,
        batching: Batching) -> list[range]:
    """The consecutive runs of rows each micro-batch takes: `size` rows each, or under a token budget as many as
    fit. A row costs its real length, or only its response's where its prompt is already in the micro-batch
    (`prompts` given: rows of one group share it)."""
    rows = len(lengths)
    if batching.max_tokens is None:
        return [range(start, min(start + size, rows)) for start in range(0, rows, size)]
    group_of = [0] * rows
    for g, members in enumerate(groups):
        for row in members:
            group_of[row] = g
    out, start, used = [], 0, 0
    for row in range(rows):
        shares = prompts is not None and row > start and group_of[row] == group_of[row - 1]
        cost = lengths[row] - (prompts[row] if shares else 0)
        full = batching.max_rows is not None and row - start >= batching.max_rows
        if row > start and (used + cost > batching.max_tokens or full):
            out.append(range(start, row))
            start, used, cost = row, 0, lengths[row]
        used += cost
    if rows:
        out.append(range(start, rows))
    return out


def pack_rows(tokens: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor | None,
              groups: list[range] | None, width: int = 1, multiple: int = 1) -> PackedRows:
    """The right-padded rows [rows, S] (each `lengths` tokens long) as one sequence of at least `width` tokens,
    padded to a multiple of `multiple` (a sequence-parallel model cuts it in that many shards). Rows of one of
    `groups` share one copy of their prompt (`prompt_lengths`); every other row is one segment. Only the positions
    that score a response are named in `source` where the prompts are known: a pass gathers nothing else."""
    rows, seq = tokens.shape
    shares = groups is not None
    groups = groups if shares else [range(r, r + 1) for r in range(rows)]
    starts, sizes, prefixes, origins, positions = [], [], [], [], []
    source = torch.full((rows, seq), -1, dtype=torch.long)
    offset, shared = 0, False

    def segment(row: int, first: int, count: int, prefix: tuple[int, int], position: int) -> None:
        nonlocal offset
        starts.append(offset)
        sizes.append(count)
        prefixes.append(prefix)
        origins.append(row * seq + torch.arange(first, first + count))
        positions.append(torch.arange(position, position + count))
        offset += count

    for group in groups:
        if not shares or len(group) < 2:
            for row in group:
                length = int(lengths[row])
                first = 0 if prompt_lengths is None else max(int(prompt_lengths[row]) - 1, 0)
                source[row, first:length] = torch.arange(offset + first, offset + length)
                segment(row, 0, length, (offset, 0), 0)
            continue
        shared = True
        prompt = int(prompt_lengths[group.start])
        prompt_at = offset
        segment(group.start, 0, prompt, (offset, 0), 0)
        for row in group:
            response = int(lengths[row]) - prompt
            if response <= 0:
                continue
            # tokens[row, prompt] is scored at the prompt's last position, the rest at their predecessors'
            source[row, prompt - 1] = prompt_at + prompt - 1
            source[row, prompt:prompt + response] = torch.arange(offset, offset + response)
            segment(row, prompt, response, (prompt_at, prompt), prompt)
    real = offset
    total = max(real, width, 1)
    total += -total % multiple
    pad = total - real
    origin = torch.cat([*origins, torch.zeros(pad, dtype=torch.long)])
    packed = tokens.reshape(-1)[origin]
    packed[real:] = 0
    position_ids = torch.cat([*positions, torch.zeros(pad, dtype=torch.long)])
    return PackedRows(packed.unsqueeze(0), position_ids.unsqueeze(0),
                      Segments(tuple(starts), tuple(sizes), tuple(prefixes)), source, origin, real, shared)


def balanced_shares(costs: list[float], units: list[range], ranks: int) -> list[list[int]]:
    """Each of `ranks` data-parallel ranks' rows, as many per rank, with about the same summed cost (the largest
    first, each to the cheapest rank with room). Whole `units` (a prompt's samples, which then share their prompt)
    where they are equal in size, divide over the ranks and leave the heaviest rank within 10 % of a row-by-row
    split's; else single rows. Each share in the rows' order."""
    rows = _lpt(costs, [range(row, row + 1) for row in range(len(costs))], ranks)
    if len({len(unit) for unit in units}) == 1 and len(units) % ranks == 0 and len(units[0]) > 1:
        grouped = _lpt(costs, units, ranks)
        if grouped[0] <= 1.1 * rows[0]:
            return grouped[1]
    return rows[1]


def _lpt(costs: list[float], units: list[range], ranks: int) -> tuple[float, list[list[int]]]:
    """The heaviest rank's cost and every rank's rows, `units` dealt largest first to the cheapest rank with room."""
    room = len(units) // ranks
    loads, taken, shares = [0.0] * ranks, [0] * ranks, [[] for _ in range(ranks)]
    for unit in sorted(units, key=lambda u: (-sum(costs[row] for row in u), u.start)):
        rank = min((r for r in range(ranks) if taken[r] < room), key=lambda r: (loads[r], r))
        shares[rank].extend(unit)
        taken[rank] += 1
        loads[rank] += sum(costs[row] for row in unit)
    return max(loads), [sorted(share) for share in shares]
