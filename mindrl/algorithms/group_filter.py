"""DAPO dynamic sampling (`filter_groups_enable`, `filter_groups_metric`, `filter_groups_max_batches`).

A prompt whose n responses all score the same has zero group-relative advantage: it costs
a full update and teaches nothing, and as accuracy rises more and more groups go flat, so
the effective batch shrinks. Dynamic sampling drops those groups and generates again until
the training batch holds `target_groups` informative prompts, giving up after
`filter_groups_max_batches` generation rounds (0 or less: no limit).

Batches are mappings of per-sample columns (tensors with one row per sample, or lists),
the n samples of a prompt contiguous, as everywhere in mindrl.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

#: what `filter_groups_metric` may name besides a verifier: the weighted total reward
TOTAL_SCORE = "score"


def kept_groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """[prompts] booleans: True where the group's values are not all equal."""
    if values.ndim != 1 or values.numel() % group_size:
        raise ValueError(f"{values.numel()} filter values do not form groups of {group_size}; give one value per "
                         f"sample with the n_samples_per_prompt samples of a prompt stored contiguously.")
    grouped = values.view(-1, group_size)
    return ~(grouped == grouped[:, :1]).all(-1)


def select_filter_values(metric: str, scores: torch.Tensor,
                         verifier_scores: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The per-sample values `filter_groups_metric` names.

    A verifier name (MindSpeed-RL's `acc`, also accepted in its internal `acc_rewards/mean`
    form) picks that verifier's unweighted scores; `score` picks the weighted total.
    """
    if metric == TOTAL_SCORE:
        return scores
    name = metric.removesuffix("_rewards/mean")
    if name not in verifier_scores:
        raise ValueError(f"filter_groups_metric {metric!r} is neither {TOTAL_SCORE!r} nor a verifier of this run "
                         f"({', '.join(sorted(verifier_scores)) or 'none'}); set it to one of them.")
    return verifier_scores[name]


def _take_rows(column: torch.Tensor | Sequence, rows: torch.Tensor) -> torch.Tensor | list:
    if torch.is_tensor(column):
        return column[rows]
    return [column[i] for i in rows.tolist()]


def _concat(parts: list, pad: float | int) -> torch.Tensor | list:
    """Rows of several rounds in one column; tensors whose later dims differ (responses of
    different padded widths) are right-padded with `pad` to the widest."""
    if not torch.is_tensor(parts[0]):
        return [item for part in parts for item in part]
    shape = [max(part.shape[d] for part in parts) for d in range(1, parts[0].ndim)]
    out = parts[0].new_full((sum(part.shape[0] for part in parts), *shape), pad)
    start = 0
    for part in parts:
        out[(slice(start, start + part.shape[0]), *(slice(0, n) for n in part.shape[1:]))] = part
        start += part.shape[0]
    return out


class GroupAccumulator:
    """Collects the informative prompt groups of successive generation rounds.

    Usage: `while not acc.done: acc.add(generate(), values)`, then `acc.batch()`. The first
    `target_groups` kept groups, in generation order, form the batch; later surplus groups
    are dropped, as DAPO does, so the update size stays fixed.
    """

    def __init__(self, target_groups: int, group_size: int, max_batches: int = 10,
                 metric: str = "acc") -> None:
        if target_groups < 1:
            raise ValueError(f"the filtered batch needs at least one prompt group, got target_groups={target_groups}.")
        if group_size < 2:
            raise ValueError("filter_groups_enable needs n_samples_per_prompt >= 2, since a group of one sample "
                             "always has equal values and would always be dropped.")
        self.target_groups, self.group_size, self.max_batches, self.metric = (target_groups, group_size,
                                                                              max_batches, metric)
        self.rounds = 0
        self.groups_seen = 0
        #: informative groups beyond the batch, dropped so the update size stays fixed
        self.surplus = 0
        self._parts: dict[str, list] = {}
        self._kept = 0

    @property
    def done(self) -> bool:
        return self._kept >= self.target_groups

    def add(self, batch: Mapping[str, torch.Tensor | Sequence], values: torch.Tensor) -> bool:
        """Keep this round's informative groups; True once the batch is full.

        Raises once `filter_groups_max_batches` rounds ran and the batch is still short.
        """
        keep = kept_groups(values, self.group_size)
        samples = values.numel()
        for key, column in batch.items():
            if len(column) != samples:
                raise ValueError(f"batch column {key!r} has {len(column)} rows but there are {samples} filter "
                                 f"values; give one value per sample.")
        self.rounds += 1
        self.groups_seen += keep.numel()
        needed = self.target_groups - self._kept
        groups = keep.nonzero().flatten()[:max(needed, 0)]
        if groups.numel():
            rows = (groups.unsqueeze(-1) * self.group_size + torch.arange(self.group_size)).flatten()
            for key, column in batch.items():
                self._parts.setdefault(key, []).append(_take_rows(column, rows))
        self._kept += groups.numel()
        self.surplus += int(keep.sum()) - groups.numel()
        if not self.done and 0 < self.max_batches <= self.rounds:
            raise ValueError(f"after {self.rounds} generation batches only {self._kept} of {self.target_groups} "
                             f"prompt groups had {self.metric} values that differ within the group; raise "
                             f"filter_groups_max_batches (0 means no limit) or use prompts the policy does not "
                             f"always solve or always fail.")
        return self.done

    def batch(self, pad_values: Mapping[str, float | int] | None = None) -> dict[str, torch.Tensor | list]:
        """The `target_groups` kept groups as one batch; `pad_values` gives each tensor column's
        padding (the tokenizer's pad id for token ids), 0 when not named."""
        if not self.done:
            raise ValueError(f"the filtered batch holds {self._kept} of {self.target_groups} prompt groups; "
                             f"call add() until done before taking it.")
        pad_values = pad_values or {}
        return {key: _concat(parts, pad_values.get(key, 0)) for key, parts in self._parts.items()}

    def metrics(self) -> dict[str, float]:
        """Counts of prompt groups over the step's rounds: kept (in the batch) + dropped (flat) + surplus
        (informative, past the batch) = every group generated."""
        flat = self.groups_seen - self._kept - self.surplus
        return {
            "filter_groups/num_gen_batches": float(self.rounds),
            "filter_groups/kept_groups": float(self._kept),
            "filter_groups/dropped_groups": float(flat),
            "filter_groups/surplus_groups": float(self.surplus),
            "filter_groups/kept_frac": self._kept / max(self.groups_seen, 1),
            "filter_groups/informative_frac": (self._kept + self.surplus) / max(self.groups_seen, 1),
        }
