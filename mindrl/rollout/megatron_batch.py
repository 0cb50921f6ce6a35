"""Book-keeping of a decode batch: which response each row is, what it may still emit, and the results.

Rows whose response has ended stay in the batch (their draws are ignored) until they are
a share of it worth a copy of the KV cache; then the survivors move to the front together.
"""

from __future__ import annotations

import torch

from mindrl.rollout.base import LENGTH, STOP, RolloutResult


class DecodeRows:
    """Per batch row: its response index, the position of the token it feeds next, how many
    tokens its response may have, whether it is still generating, and its sampling generator."""

    def __init__(self, positions: torch.Tensor, budgets: torch.Tensor, generators: list[torch.Generator]) -> None:
        self.response = torch.arange(len(positions), device=positions.device)
        self.position, self.budget, self.generators = positions, budgets, generators
        self.live = torch.ones(len(positions), dtype=torch.bool, device=positions.device)

    def keep(self, rows: torch.Tensor) -> None:
        self.response, self.position, self.budget, self.live = (
            t[rows] for t in (self.response, self.position, self.budget, self.live))
        self.generators = [self.generators[row] for row in rows.tolist()]


class Responses:
    """Every response's tokens and log-probs as they are drawn, and why each ended."""

    def __init__(self, count: int, longest: int, eos: torch.Tensor) -> None:
        device = eos.device
        self.tokens = torch.zeros(count, longest, dtype=torch.long, device=device)
        self.log_probs = torch.zeros(count, longest, device=device)
        self.lengths = torch.zeros(count, dtype=torch.long, device=device)
        self.stopped = torch.zeros(count, dtype=torch.bool, device=device)
        self.eos = eos

    def record(self, step: int, rows: DecodeRows, tokens: torch.Tensor, log_probs: torch.Tensor) -> int:
        """Token `step` of every live row; rows that drew an end-of-sequence token or reached their
        budget stop. Returns how many rows are still live."""
        live = rows.live
        index = rows.response[live]
        self.tokens[index, step] = tokens[live]
        self.log_probs[index, step] = log_probs[live]
        self.lengths[index] = step + 1
        eos = torch.isin(tokens, self.eos) & live
        self.stopped[rows.response[eos]] = True
        rows.live = live & ~eos & (step + 1 < rows.budget)
        return int(rows.live.sum())

    def result(self) -> RolloutResult:
        lengths = self.lengths.tolist()
        return RolloutResult([row[:n] for row, n in zip(self.tokens.tolist(), lengths, strict=True)],
                             [row[:n] for row, n in zip(self.log_probs.tolist(), lengths, strict=True)],
                             [STOP if stopped else LENGTH for stopped in self.stopped.tolist()])
