"""Context parallelism: one padding-free packed sequence cut over the CP ranks, and the attention that joins it.

Every layer but attention works token by token, so a CP rank runs them on its share of the tokens alone. The split
is Megatron's THD one: each sample is cut into 2 × CP chunks and rank r keeps chunks r and 2·CP − 1 − r, so under
causal attention every rank has about the same work (an early chunk attends to little, its partner to much). Chunk
sizes differ by at most one token where a sample does not divide (a sample shorter than 2 × CP leaves some chunks
empty), and every rank's share is padded to the longest share: the pipeline exchanges one shape. Each token keeps its
own RoPE position (the model rotates by the position ids it is given), so nothing else needs slicing.

Two attention algorithms join the shares (`context_parallel_algo`, MindSpeed-RL's names):
- `ulysses_cp_algo` (all-to-all): queries, keys and values go from sequence shards to head shards, each rank
  attends over the whole sequence for its heads (mindrl.models.attention.packed_attention), and the output goes back
  to sequence shards. The heads and key-value groups of a TP rank must divide by CP.
- `megatron_cp_algo` (ring): each rank keeps its queries while the keys and values travel the ring, CP − 1 hops
  per layer; each block it can see is attended as it passes and merged into the running output by its log-sum-exp
  (online softmax). The backward sends the keys and values round again with their gradients, which arrive at their
  owner after a last hop. No head condition. A block needs its log-sum-exp, which torch's public attention does not
  return: on CPU a large block runs torch's fused flash kernel directly (its forward returns the log-sum-exp, its
  backward takes the merged output and log-sum-exp), every other block runs as fp32 matmuls a tile of queries at a
  time, so no score matrix outlives its tile.

A response that shares its prompt with other samples (mindrl/models/micro_batches.py) sees every key of that prompt,
wherever its chunks are.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import all_to_all

from mindrl.models.attention import MATERIALISE_MAX, Segments, SplitSequence, packed_attention

#: score elements per tile of a ring block (fp32): bounds its temporaries
_TILE_ELEMENTS = 1 << 22


class Block(NamedTuple):
    """Queries [start, stop) of a rank's share attending to the `keys` ranges of the share the ring holds, the last
    `diagonal` of those keys being the queries' own chunk (attended causally; 0: every key in full)."""

    start: int
    stop: int
    keys: tuple[tuple[int, int], ...]
    diagonal: int


@dataclass(frozen=True)
class Piece:
    """One chunk of one sample on a rank: where it is in the packed sequence and in the rank's share."""

    segment: int
    chunk: int
    start: int  # in the packed sequence
    local: int  # in the rank's share
    length: int


@dataclass(frozen=True)
class ContextSplit(SplitSequence):
    """How one padding-free packed sequence (its `segments`) is cut over `size` CP ranks, seen from `rank`; the
    attention core's mask under CP. Each rank's share is padded to the longest one's tokens, to at least `width`
    and to a multiple of `multiple` (a sequence-parallel model cuts each share over its TP ranks)."""

    segments: Segments
    size: int
    rank: int
    algo: str
    multiple: int = 1
    width: int = 1

    def to(self, device: torch.device | str) -> ContextSplit:
        return self  # plain offsets

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               enable_gqa: bool = False) -> torch.Tensor:
        """This rank's [length, heads, dim] attention output for its share of the queries, over every rank's keys
        and values ([length, groups, dim] each)."""
        group = parallel_state.get_context_parallel_group()
        if self.algo == "ulysses":
            return _ulysses(query, key, value, self, scale, enable_gqa, group)
        return _Ring.apply(query, key, value, self, scale, group)

    @cached_property
    def pieces(self) -> tuple[tuple[Piece, ...], ...]:
        return tuple(_pieces(self.segments, self.size, rank) for rank in range(self.size))

    @cached_property
    def length(self) -> int:
        """Tokens of each rank's share, padding included (the same on every rank)."""
        length = max(max(self.real(rank) for rank in range(self.size)), self.width, 1)
        return length + -length % self.multiple

    @cached_property
    def prefix_of(self) -> tuple[int | None, ...]:
        """The segment whose tokens are each segment's prefix (its shared prompt), or None."""
        by_start = {(start, length): s for s, (start, length) in
                    enumerate(zip(self.segments.starts, self.segments.lengths, strict=True))}
        out = []
        for first, length in self.segments.prefixes:
            if not length:
                out.append(None)
                continue
            if (first, length) not in by_start:
                raise ValueError(f"a prefix of {length} tokens at {first} is no segment of the packed sequence; "
                                 f"context parallelism splits prefixes that are whole samples (shared prompts).")
            out.append(by_start[first, length])
        return tuple(out)

    def index(self, rank: int | None = None) -> torch.Tensor:
        """[length] the packed position of each token of `rank`'s share (this rank's by default); −1 for padding."""
        rank = self.rank if rank is None else rank
        out = torch.full((self.length,), -1, dtype=torch.long)
        for piece in self.pieces[rank]:
            out[piece.local:piece.local + piece.length] = torch.arange(piece.start, piece.start + piece.length)
        return out

    @cached_property
    def key_index(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Each ring block's keys as one index into the holder's share (the backward gathers and scatters by it)."""
        return tuple(tuple(torch.cat([torch.arange(a, b) for a, b in block.keys]) for block in blocks)
                     for blocks in self.ring_plan)

    @cached_property
    def packed_order(self) -> torch.Tensor:
        """Ulysses: the slots of the ranks' shares laid end to end (rank by rank) that hold the packed sequence's
        tokens, in the packed sequence's order."""
        order = torch.cat([self.index(rank) for rank in range(self.size)])
        real = (order >= 0).nonzero().squeeze(1)
        return real[order[order >= 0].argsort()]

    def real(self, rank: int | None = None) -> int:
        """Tokens of `rank`'s share before its padding."""
        return sum(piece.length for piece in self.pieces[self.rank if rank is None else rank])

    @cached_property
    def ring_plan(self) -> tuple[tuple[Block, ...], ...]:
        """For each ring step (the keys of rank − step held), the blocks this rank attends."""
        plan = []
        for step in range(self.size):
            holder = self.pieces[(self.rank - step) % self.size]
            blocks = []
            for query in self.pieces[self.rank]:
                if not query.length:
                    continue
                full, diagonal = [], 0
                prefix = self.prefix_of[query.segment]
                for key in holder:
                    if not key.length:
                        continue
                    if key.segment == prefix or (key.segment == query.segment and key.chunk < query.chunk):
                        full.append((key.local, key.local + key.length))
                    elif key.segment == query.segment and key.chunk == query.chunk:
                        diagonal = key.length
                        own = (key.local, key.local + key.length)
                if diagonal:
                    full.append(own)
                if full:
                    blocks.append(Block(query.local, query.local + query.length, tuple(full), diagonal))
            plan.append(tuple(blocks))
        return tuple(plan)


def share(mb: dict, real: int, size: int, rank: int, algo: str, multiple: int = 1, width: int = 1) -> dict:
    """A packed micro-batch's per-token entries (`tokens`, `position_ids`, replayed `routes`: [1, T, ...]) cut to
    this rank's share, its Segments made a ContextSplit, `source` pointing into the share (−1 where another rank
    scores the token) and `real_lengths` the share's tokens before its padding (padding: token 0, position 0)."""
    layout = ContextSplit(mb["attention_mask"], size, rank, algo, multiple, width)
    index = layout.index()
    real_slots = index >= 0
    taken = index.clamp(min=0)
    out = {"attention_mask": layout, "real_lengths": torch.tensor([layout.real()])}
    for key in ("tokens", "position_ids", "routes"):
        if key in mb:
            values = mb[key][:, taken]
            # padding replays routes 0 … k − 1, as a packed sequence's own padding does
            values[:, ~real_slots] = torch.arange(values.shape[-1], dtype=values.dtype) if key == "routes" else 0
            out[key] = values
    local = torch.full((max(real, 1),), -1, dtype=torch.long)
    local[index[real_slots]] = real_slots.nonzero().squeeze(1)
    source = mb["source"]
    out["source"] = torch.where(source >= 0, local[source.clamp(min=0)], -1)
    return out


class _Merge(torch.autograd.Function):
    """Summed over the CP ranks; the backward hands each rank the whole gradient (each scored only its tokens)."""

    @staticmethod
    def forward(ctx, values: torch.Tensor) -> torch.Tensor:
        values = values.clone()
        dist.all_reduce(values, group=parallel_state.get_context_parallel_group())
        return values

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def merge(values: torch.Tensor) -> torch.Tensor:
    """Per-token results (log-probs, entropies, values) that each CP rank gave for the tokens of its share (zeros
    elsewhere), summed: every rank then holds all of them, and computes the same loss from them. Without CP a rank
    scored them all: they are returned as they are."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return values
    return _Merge.apply(values)


def _pieces(segments: Segments, size: int, rank: int) -> tuple[Piece, ...]:
    """Chunks rank and 2·size − 1 − rank of every sample, in order, laid end to end."""
    out, local = [], 0
    for s, (start, length) in enumerate(zip(segments.starts, segments.lengths, strict=True)):
        bounds = _chunk_bounds(length, 2 * size)
        for chunk in (rank, 2 * size - 1 - rank):
            first, stop = bounds[chunk], bounds[chunk + 1]
            out.append(Piece(s, chunk, start + first, local, stop - first))
            local += stop - first
    return tuple(out)


def _chunk_bounds(length: int, chunks: int) -> list[int]:
    """Offsets of `chunks` consecutive chunks of `length` tokens, the first `length % chunks` one token longer."""
    base, extra = divmod(length, chunks)
    bounds = [0]
    for c in range(chunks):
        bounds.append(bounds[-1] + base + (c < extra))
    return bounds


def _ulysses(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: ContextSplit, scale: float,
             enable_gqa: bool, group: dist.ProcessGroup) -> torch.Tensor:
    size = layout.size
    packed_order = layout.packed_order.to(query.device)

    def to_heads(x: torch.Tensor) -> torch.Tensor:
        # [length, heads, dim] → heads cut in `size` slices, slice j to rank j → [size · length, heads / size, dim]
        length, heads, dim = x.shape
        sliced = x.view(length, size, heads // size, dim).transpose(0, 1).reshape(size * length, heads // size, dim)
        return all_to_all(group, sliced).index_select(0, packed_order)

    out = packed_attention(to_heads(query), to_heads(key), to_heads(value), layout.segments, scale, enable_gqa)
    slots = out.new_zeros((size * layout.length, *out.shape[1:])).index_copy(0, packed_order, out)
    back = all_to_all(group, slots)  # [size (head slice), length, heads / size, dim]
    length, heads = query.shape[:2]
    return back.view(size, length, heads // size, -1).transpose(0, 1).reshape(length, heads, -1)


class _Shift:
    """`tensor` on its way to the next rank of the ring while the previous rank's comes in: the caller computes
    meanwhile and takes the incoming one with `wait`."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        ranks = dist.get_process_group_ranks(group)
        me = ranks.index(dist.get_rank())
        self.received = torch.empty_like(tensor)
        self.requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor.contiguous(), ranks[(me + 1) % len(ranks)], group),
            dist.P2POp(dist.irecv, self.received, ranks[(me - 1) % len(ranks)], group)])

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.received


def _tiles(rows: int, keys: int, heads: int) -> range:
    step = max(1, _TILE_ELEMENTS // max(1, keys * heads))
    return range(0, rows, step)


def _heads_first(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[L, heads, dim] → fp32 [groups, heads / groups · L, dim]: a query group's heads share its keys."""
    length, heads, dim = x.shape
    return x.float().permute(1, 0, 2).reshape(groups, heads // groups * length, dim)


def _scores(q: torch.Tensor, k: torch.Tensor, diagonal: int, rows: range, length: int, scale: float) -> torch.Tensor:
    """[groups, per · tile, keys] scaled scores of the tile `rows` of `length` queries (heads-first, a group's heads
    one after another), the last `diagonal` keys masked causally."""
    groups, _, dim = q.shape
    per = q.shape[1] // length
    tile = q.view(groups, per, length, dim)[:, :, rows.start:rows.stop].reshape(groups, -1, dim)
    s = torch.bmm(tile, k.transpose(1, 2)).mul_(scale)
    if diagonal:
        keys = k.shape[1]
        query = torch.arange(rows.start, rows.stop, device=q.device).unsqueeze(1)
        hidden = torch.arange(keys, device=q.device) - (keys - diagonal) > query  # [tile, keys]
        s.view(groups, per, len(rows), keys).masked_fill_(hidden, float("-inf"))
    return s


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: ContextSplit, scale: float,
                group: dist.ProcessGroup) -> torch.Tensor:
        length, heads, width = query.shape
        groups = key.shape[1]
        out = torch.zeros((length, heads, value.shape[-1]), dtype=torch.float32, device=query.device)
        lse = torch.full((length, heads), float("-inf"), dtype=torch.float32, device=query.device)
        held = torch.cat([key, value], dim=-1)  # one message a hop; values may be narrower (multi-latent attention)
        for step, blocks in enumerate(layout.ring_plan):
            shift = _Shift(held, group) if step < layout.size - 1 else None
            for (q0, q1, ranges, diagonal), index in zip(blocks, layout.key_index[step], strict=True):
                keys = held.index_select(0, index.to(query.device)) if len(ranges) > 1 else \
                    held[ranges[0][0]:ranges[0][1]]
                block_out, block_lse = _attend(query[q0:q1], keys[..., :width], keys[..., width:], diagonal, scale,
                                               groups)
                merged = torch.logaddexp(lse[q0:q1], block_lse)
                out[q0:q1] = out[q0:q1] * (lse[q0:q1] - merged).exp().unsqueeze(-1) + \
                    block_out * (block_lse - merged).exp().unsqueeze(-1)
                lse[q0:q1] = merged
            if shift is not None:
                held = shift.wait()
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.layout, ctx.scale, ctx.group = layout, scale, group
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        query, key, value, out, lse = ctx.saved_tensors
        layout, scale, group = ctx.layout, ctx.scale, ctx.group
        groups, width = key.shape[1], key.shape[-1]
        grad = grad.float()
        delta = (grad * out).sum(-1)  # [length, heads]: Σ_d dO·O, the softmax's backward term
        dq = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        held = torch.cat([key, value], dim=-1)
        held_grad = torch.zeros_like(held, dtype=torch.float32)
        for step, blocks in enumerate(layout.ring_plan):
            # the keys and values go on at once (they do not change); their gradients once this rank added its part
            shift = _Shift(held, group) if step < layout.size - 1 else None
            for (q0, q1, _, diagonal), index in zip(blocks, layout.key_index[step], strict=True):
                index = index.to(query.device)
                keys = held.index_select(0, index)
                dq_block, dk, dv = _attend_grad(query[q0:q1], keys[..., :width], keys[..., width:], grad[q0:q1],
                                                out[q0:q1], delta[q0:q1], lse[q0:q1], diagonal, scale, groups)
                dq[q0:q1] += dq_block
                held_grad[..., :width].index_add_(0, index, dk)
                held_grad[..., width:].index_add_(0, index, dv)
            if shift is not None:  # the gradients travel after the keys and values they are of
                held_grad = _Shift(held_grad, group).wait()
                held = shift.wait()
        if layout.size > 1:  # the last holder's gradients go home
            held_grad = _Shift(held_grad, group).wait()
        return (dq.to(query.dtype), held_grad[..., :width].to(key.dtype), held_grad[..., width:].to(value.dtype),
                None, None, None)


def _fused(query: torch.Tensor, keys: int) -> bool:
    """Whether a block runs torch's fused CPU kernel (which hands back the log-sum-exp and takes it in its backward):
    on CPU where the score matrix is large, as mindrl.models.attention decides for its own segments."""
    return query.device.type == "cpu" and query.shape[0] * query.shape[1] * keys > MATERIALISE_MAX


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, diagonal: int, scale: float,
            groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    if _fused(query, key.shape[0]):
        return _fused_block(query, key, value, diagonal, scale, groups)
    return _block(query, key, value, diagonal, scale, groups)


def _attend_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grad: torch.Tensor, out: torch.Tensor,
                 delta: torch.Tensor, lse: torch.Tensor, diagonal: int, scale: float, groups: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _fused(query, key.shape[0]):
        return _fused_block_grad(query, key, value, grad, out, lse, diagonal, scale, groups)
    return _block_grad(query, key, value, grad, delta, lse, diagonal, scale, groups)


def _fused_parts(keys: int, diagonal: int) -> list[tuple[slice, bool]]:
    """The fused kernel's causal mask is aligned to the first key: the keys before the diagonal go in one call, the
    diagonal (as many keys as queries) in another."""
    full = keys - diagonal
    return [(slice(0, full), False)] * bool(full) + [(slice(full, keys), True)] * bool(diagonal)


def _fused_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, groups: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 [1, heads, L, dim] queries and keys and values repeated for each group's heads; the kernel takes one head
    size, so all three get zero columns up to the wider of the key and value widths, which change no score and no
    output column."""
    per, width = query.shape[1] // groups, max(query.shape[-1], value.shape[-1])
    return (_widened(query, width).permute(1, 0, 2).unsqueeze(0).contiguous(),
            *(_widened(x, width).repeat_interleave(per, dim=1).permute(1, 0, 2).unsqueeze(0).contiguous()
              for x in (key, value)))


def _widened(x: torch.Tensor, width: int) -> torch.Tensor:
    """fp32 `x` with zero columns up to `width`."""
    return torch.nn.functional.pad(x.float(), (0, width - x.shape[-1]))


def _fused_block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, diagonal: int, scale: float,
                 groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """_block by torch's fused CPU kernel."""
    q, k, v = _fused_inputs(query, key, value, groups)
    out = lse = None
    for keys, causal in _fused_parts(k.shape[2], diagonal):
        part, part_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k[:, :, keys], v[:, :, keys], 0.0, causal, scale=scale)
        if out is None:
            out, lse = part, part_lse
        else:
            merged = torch.logaddexp(lse, part_lse)
            out = out * (lse - merged).exp().unsqueeze(-1) + part * (part_lse - merged).exp().unsqueeze(-1)
            lse = merged
    return out[0].transpose(0, 1)[..., :value.shape[-1]], lse[0].t()


def _fused_block_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grad: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor, diagonal: int, scale: float, groups: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_block_grad by the fused kernel's backward, given the merged output and log-sum-exp: its probabilities are
    then the merged softmax's, restricted to this block."""
    q, k, v = _fused_inputs(query, key, value, groups)
    g, o = (_widened(x, q.shape[-1]).permute(1, 0, 2).unsqueeze(0).contiguous() for x in (grad, out))
    l_all = lse.t().unsqueeze(0).contiguous()
    dq, dks, dvs = torch.zeros_like(q), [], []
    for keys, causal in _fused_parts(k.shape[2], diagonal):
        part_dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k[:, :, keys].contiguous(), v[:, :, keys].contiguous(), o, l_all, 0.0, causal, scale=scale)
        dq += part_dq
        dks.append(dk)
        dvs.append(dv)
    heads, dim = q.shape[1], q.shape[3]

    def folded(parts: list[torch.Tensor]) -> torch.Tensor:  # each group's heads' gradients summed: [S, groups, dim]
        return torch.cat(parts, dim=2)[0].view(groups, heads // groups, -1, dim).sum(1).permute(1, 0, 2)

    width, value_width = key.shape[-1], value.shape[-1]
    return dq[0].transpose(0, 1)[..., :width], folded(dks)[..., :width], folded(dvs)[..., :value_width]


def _block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, diagonal: int, scale: float,
           groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax attention of [L, heads, dim] queries over [S, groups, dim] keys and [S, groups, value dim] values
    (the last `diagonal` keys causally): fp32 output [L, heads, value dim] and log-sum-exp [L, heads]."""
    (length, heads), dim = query.shape[:2], value.shape[-1]
    q, k, v = (_heads_first(x, groups) for x in (query, key, value))
    per = heads // groups
    out = q.new_empty(groups, per, length, dim)
    lse = q.new_empty(groups, per, length)
    tiles = _tiles(length, k.shape[1], heads)
    for start in tiles:
        rows = range(start, min(start + tiles.step, length))
        s = _scores(q, k, diagonal, rows, length, scale)
        tile_lse = s.logsumexp(-1, keepdim=True)
        out[:, :, rows.start:rows.stop] = torch.bmm((s - tile_lse).exp_(), v).view(groups, per, len(rows), dim)
        lse[:, :, rows.start:rows.stop] = tile_lse.view(groups, per, len(rows))
    return out.reshape(heads, length, dim).transpose(0, 1), lse.reshape(heads, length).t()


def _block_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grad: torch.Tensor, delta: torch.Tensor,
                lse: torch.Tensor, diagonal: int, scale: float, groups: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's share of dQ [L, heads, dim] and its dK, dV [S, groups, dim or value dim], from the merged output's
    gradient (`grad`), its Σ dO·O (`delta`) and log-sum-exp (`lse`), both [L, heads]."""
    length, heads, dim = query.shape
    value_dim = value.shape[-1]
    per = heads // groups
    q, k, v, g = (_heads_first(x, groups) for x in (query, key, value, grad))
    lse_h = lse.t().reshape(groups, per, length)
    delta_h = delta.t().reshape(groups, per, length)
    dq = torch.zeros_like(q).view(groups, per, length, dim)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    tiles = _tiles(length, k.shape[1], heads)
    for start in tiles:
        rows = range(start, min(start + tiles.step, length))
        s = _scores(q, k, diagonal, rows, length, scale)
        p = (s - lse_h[:, :, rows.start:rows.stop].reshape(groups, -1, 1)).exp_()
        g_tile = g.view(groups, per, length, value_dim)[:, :, rows.start:rows.stop].reshape(groups, -1, value_dim)
        q_tile = q.view(groups, per, length, dim)[:, :, rows.start:rows.stop].reshape(groups, -1, dim)
        dv += torch.bmm(p.transpose(1, 2), g_tile)
        ds = p.mul_(torch.bmm(g_tile, v.transpose(1, 2)) -
                    delta_h[:, :, rows.start:rows.stop].reshape(groups, -1, 1)).mul_(scale)
        dq[:, :, rows.start:rows.stop] = torch.bmm(ds, k).view(groups, per, len(rows), dim)
        dk += torch.bmm(ds.transpose(1, 2), q_tile)
    return (dq.reshape(heads, length, dim).transpose(0, 1), dk.permute(1, 0, 2), dv.permute(1, 0, 2))
