"""One TP rank's tensor under a new TP cut, filled straight from the slices of the old one (mg → mg).

tp_layout describes both cuts in the rows (and column blocks) of the HF tensors; where a target
piece and a source piece take the same HF rows and columns, those go from the source slice to the
target slice directly. Each byte is copied once, where joining the source's slices into the full
tensor and cutting it again copied it twice, and the TP cut stays described in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mindrl.models.tp_layout import Piece


@dataclass(frozen=True)
class Copy:
    """Rows [src, src + count) of source TP rank `rank`'s slice are rows [dst, dst + count) of the
    target's; of their columns, `src_cols` and `dst_cols` (row-parallel layers cut columns)."""

    rank: int
    src: int
    dst: int
    count: int
    src_cols: slice
    dst_cols: slice


def fill_rank_tensor(out: torch.Tensor, target: list[Piece], source: list[list[Piece]],
                     shards: list[torch.Tensor], tp_out: int, tp_in: int) -> torch.Tensor:
    """Fill `out`, whose pieces under the new cut (TP `tp_out`) are `target`, from the source
    slices `shards` (TP `tp_in`, pieces `source[rank]`); rows no piece covers (TP vocabulary
    padding) are zeroed."""
    for copy in copies(target, source, tp_out, tp_in, _hf_width(out, target, tp_out)):
        rows = shards[copy.rank][copy.src:copy.src + copy.count]
        into = out[copy.dst:copy.dst + copy.count]
        if out.ndim > 1:
            rows, into = rows[:, copy.src_cols], into[:, copy.dst_cols]
        into.copy_(rows)
    covered = sum(piece.count for piece in target)
    if covered < out.shape[0]:
        out[covered:].zero_()
    return out


def copies(target: list[Piece], source: list[list[Piece]], tp_out: int, tp_in: int, width: int) -> list[Copy]:
    """Where target and source pieces of the same HF tensor (`width` columns) overlap."""
    out = []
    for want in target:
        want_cols = _columns(want, tp_out, width)
        for rank, pieces in enumerate(source):
            for have in pieces:
                first = max(want.hf_start, have.hf_start)
                stop = min(want.hf_start + want.count, have.hf_start + have.count)
                have_cols = _columns(have, tp_in, width)
                lo, hi = max(want_cols[0], have_cols[0]), min(want_cols[1], have_cols[1])
                if have.hf_name == want.hf_name and first < stop and lo < hi:
                    out.append(Copy(rank, have.start + first - have.hf_start, want.start + first - want.hf_start,
                                    stop - first, slice(lo - have_cols[0], hi - have_cols[0]),
                                    slice(lo - want_cols[0], hi - want_cols[0])))
    return out


def _columns(piece: Piece, tp: int, width: int) -> tuple[int, int]:
    if piece.col_block is None:
        return 0, width
    block = width // tp
    return piece.col_block * block, (piece.col_block + 1) * block


def _hf_width(out: torch.Tensor, target: list[Piece], tp: int) -> int:
    """Columns of the HF tensor behind `out` (1 for a vector)."""
    if out.ndim == 1:
        return 1
    cut = any(piece.col_block is not None for piece in target)
    return out.shape[1] * (tp if cut else 1)
