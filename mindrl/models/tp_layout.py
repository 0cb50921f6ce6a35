"""The TP cut as copy instructions: which rows of which HF tensor land where in each TP rank's tensor.

Building a rank's fused QKV by fusing the full HF tensors and then cutting the result copies
every byte twice; so does joining the TP shards and then splitting QKV / gate-up back into HF
tensors. With the instructions here each byte is copied once, in either direction: the
converter fills a rank's tensor straight from the memory-mapped HF tensors, and the weight
sync fills each HF tensor straight from the gathered TP shards.

The instructions are derived, not written down a second time: the one mapping
(hf_mapping.hf_to_mcore_layer and sharding.split_full_tensor) is run once per architecture and
TP size on *index* tensors, whose entries say which HF tensor and row (and which column block)
they came from, and the result is read back as runs of contiguous rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from mindrl.config import ModelArch, ParallelConfig
from mindrl.models import hf_mapping as hfm
from mindrl.models import sharding

_ROW_BITS = 40  # an index entry is (HF tensor number << _ROW_BITS) | row


@dataclass(frozen=True)
class Piece:
    """Rows [hf_start, hf_start + count) of HF tensor `hf_name` are rows [start, start + count) of
    the rank's tensor; of the HF tensor's columns, all (`col_block` None) or block `col_block`
    of TP equal blocks (row-parallel layers cut their input dimension)."""

    hf_name: str
    hf_start: int
    start: int
    count: int
    col_block: int | None = None


#: per Megatron full name, per TP rank, the pieces that make that rank's tensor
Layout = dict[str, list[list[Piece]]]


@lru_cache(maxsize=32)
def _layer_layout(arch: ModelArch, tp: int) -> Layout:
    """Pieces of one decoder layer, named by suffix (layer prefixes are added by the caller)."""
    names, shapes = hfm.hf_layer_names(arch), hfm.hf_layer_shapes(arch)
    rows_probe, cols_probe = {}, {}
    for number, name in enumerate(names):
        rows = torch.arange(shapes[name][0], dtype=torch.int64) | (number << _ROW_BITS)
        if len(shapes[name]) == 1:
            rows_probe[name] = cols_probe[name] = rows
        else:  # one column per TP block: enough to see which block each rank gets
            rows_probe[name] = rows.unsqueeze(1).expand(-1, tp).contiguous()
            cols_probe[name] = torch.arange(tp, dtype=torch.int64).expand(shapes[name][0], -1).contiguous()
    by_rows = hfm.hf_to_mcore_layer(rows_probe, arch)
    by_cols = hfm.hf_to_mcore_layer(cols_probe, arch)
    par = ParallelConfig(tp, 1)
    layout: Layout = {}
    for suffix, probe in by_rows.items():
        full = hfm.mcore_layer_prefix(0) + suffix
        row_shards = sharding.split_full_tensor(full, probe, arch, par)
        col_shards = sharding.split_full_tensor(full, by_cols[suffix], arch, par)
        layout[suffix] = [_runs(names, rows_shard, cols_shard, tp)
                          for rows_shard, cols_shard in zip(row_shards, col_shards, strict=True)]
    return layout


def _runs(names: list[str], rows_shard: torch.Tensor, cols_shard: torch.Tensor, tp: int) -> list[Piece]:
    """Read a rank's index tensor back as runs of contiguous rows of one HF tensor."""
    codes = (rows_shard if rows_shard.ndim == 1 else rows_shard[:, 0]).tolist()
    col_block = None
    if cols_shard.ndim == 2 and cols_shard.shape[1] < tp:
        col_block = int(cols_shard[0, 0])
    pieces: list[Piece] = []
    for position, code in enumerate(codes):
        number, row = code >> _ROW_BITS, code & ((1 << _ROW_BITS) - 1)
        last = pieces[-1] if pieces else None
        if last and last.hf_name == names[number] and last.hf_start + last.count == row:
            pieces[-1] = Piece(last.hf_name, last.hf_start, last.start, last.count + 1, col_block)
        else:
            pieces.append(Piece(names[number], row, position, 1, col_block))
    return pieces


def rank_pieces(arch: ModelArch, tp: int, name: str) -> list[list[Piece]]:
    """Per TP rank, the pieces of Megatron full-model tensor `name`, with full HF names.

    Vocabulary tensors take the rows of their TP slice that are real tokens; the slice's rows
    past the vocabulary (TP padding) are in no piece and must be zero.
    """
    if name in (hfm.EMBEDDING[1], hfm.OUTPUT[1]):
        hf_name = hfm.EMBEDDING[0] if name == hfm.EMBEDDING[1] else hfm.OUTPUT[0]
        out = []
        for rank in range(tp):
            start, stop, _ = sharding.vocab_rows(arch, ParallelConfig(tp, 1), rank)
            out.append([Piece(hf_name, start, 0, stop - start)] if stop > start else [])
        return out
    replicated = {hfm.FINAL_NORM[1]: (hfm.FINAL_NORM[0], arch.hidden_size),
                  hfm.SCORE[1]: (hfm.SCORE[0], arch.num_labels)}
    if name.startswith(hfm.VISION[1]):  # the vision tower: renamed, replicated on every TP rank
        replicated[name] = (hfm.VISION[0] + name.removeprefix(hfm.VISION[1]), sharding.full_param_shapes(arch)[name][0])
    if name in replicated:
        hf_name, rows = replicated[name]
        return [[Piece(hf_name, 0, 0, rows)] for _ in range(tp)]
    index, suffix = _split_layer_name(name)
    prefix = hfm.hf_layer_prefix(index)
    return [[Piece(prefix + p.hf_name, p.hf_start, p.start, p.count, p.col_block) for p in pieces]
            for pieces in _layer_layout(arch.layer_arch(index), tp)[suffix]]


def layer_suffixes(arch: ModelArch, index: int) -> list[str]:
    """The Megatron names inside decoder layer `index`, in the order the mapping makes them: a converter
    writing in this order writes the same rank files as one that runs the mapping."""
    return list(_layer_suffixes(arch.layer_arch(index)))


@lru_cache(maxsize=32)
def _layer_suffixes(arch: ModelArch) -> tuple[str, ...]:
    shapes = hfm.hf_layer_shapes(arch)
    # The mapping fuses and orders by rows: one column per tensor tells it all, at no cost.
    narrow = {}
    for name in hfm.hf_layer_names(arch):
        rows, *cols = shapes[name]
        narrow[name] = torch.empty(rows, *(1 for _ in cols))
    return tuple(hfm.hf_to_mcore_layer(narrow, arch))


def hf_pieces(arch: ModelArch, tp: int, names: list[str]) -> dict[str, list[tuple[str, int, Piece]]]:
    """For the HF tensors made from Megatron tensors `names`: (Megatron name, TP rank, piece) of
    the pieces that fill them, each HF row block once (a replicated tensor from TP rank 0)."""
    out: dict[str, list[tuple[str, int, Piece]]] = {}
    seen: set[tuple[str, int, int, int | None]] = set()
    for name in names:
        for rank, pieces in enumerate(rank_pieces(arch, tp, name)):
            for piece in pieces:
                block = (piece.hf_name, piece.hf_start, piece.count, piece.col_block)
                if block not in seen:
                    seen.add(block)
                    out.setdefault(piece.hf_name, []).append((name, rank, piece))
    return out


def fill_rank_tensor(out: torch.Tensor, pieces: list[Piece], source: dict[str, torch.Tensor], tp: int) -> torch.Tensor:
    """Copy every piece from the HF tensors `source` into `out` (one copy per byte, dtype cast on
    the way); rows no piece covers (TP vocabulary padding) are zeroed."""
    covered = 0
    for piece in pieces:
        out[piece.start:piece.start + piece.count].copy_(_hf_block(source[piece.hf_name], piece, tp))
        covered += piece.count
    if covered < out.shape[0]:
        out[covered:].zero_()
    return out


def fill_hf_tensor(out: torch.Tensor, pieces: list[tuple[str, int, Piece]],
                   shards: dict[str, list[torch.Tensor]], tp: int) -> torch.Tensor:
    """Copy every piece from the TP shards (`shards[megatron name][rank]`) into HF tensor `out`."""
    for name, rank, piece in pieces:
        _hf_block(out, piece, tp).copy_(shards[name][rank][piece.start:piece.start + piece.count])
    return out


def _hf_block(hf: torch.Tensor, piece: Piece, tp: int) -> torch.Tensor:
    rows = hf[piece.hf_start:piece.hf_start + piece.count]
    if piece.col_block is None:
        return rows
    width = hf.shape[1] // tp
    return rows[:, piece.col_block * width:(piece.col_block + 1) * width]


def _split_layer_name(name: str) -> tuple[int, str]:
    parts = name.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["decoder", "layers"] or not parts[2].isdigit():
        raise KeyError(f"{name} is not a Megatron parameter this layout knows.")
    return int(parts[2]), parts[3]
