"""Prompt batches from the preprocessed parquet, in an order a checkpoint can resume exactly.

Each epoch is a permutation of the rows seeded by (seed, epoch) — or file order with
`no_shuffle` — cut into batches of `global_batch_size` prompts; a last batch too short to
fill is left out of that epoch. The position (epoch, next row) is all the state there is, so
a run resumed from a checkpoint taken at the end of an epoch goes on into the next one
rather than finding nothing left (a failure other trainers have had).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch

from mindrl.config import ConfigError
from mindrl.data.images import PromptImages, read_images
from mindrl.data.readers import read_columns

COLUMNS = ("prompt_ids", "answer", "data_source")
Row = TypeVar("Row")


@dataclass
class Prompt:
    ids: list[int]
    label: str
    data_source: str
    #: an image question's images (its ids hold their placeholders)
    images: PromptImages | None = None


def split_path(data_path: str | Path, split: str) -> Path:
    """`data_path` as a cli/preprocess_data.py folder (its <split>.parquet) or a parquet file."""
    path = Path(data_path)
    if path.is_dir():
        path = path / f"{split}.parquet"
    return path


def read_prompts(path: str | Path) -> list[Prompt]:
    columns = read_columns(path, COLUMNS)
    images = read_images(path) or [None] * len(columns["prompt_ids"])
    rows = zip(columns["prompt_ids"], columns["answer"], columns["data_source"], images, strict=True)
    return [Prompt(list(ids), str(label), str(source), image) for ids, label, source, image in rows]


def check_prompt_lengths(prompts: list[Prompt], limit: int, path: Path) -> None:
    """Every prompt fits rl_config.max_prompt_length, which the engine's room (max_model_len) was checked against:
    a longer one would leave its response no room, found only once the workers generate it."""
    over = [len(p.ids) for p in prompts if len(p.ids) > limit]
    if over:
        raise ConfigError(f"{len(over)} of the {len(prompts)} prompts in {path} are longer than "
                          f"rl_config.max_prompt_length={limit} tokens (the longest has {max(over)}); preprocess them "
                          f"with cli/preprocess_data.py's max_prompt_length at most {limit}, which leaves longer ones "
                          f"out, or raise max_prompt_length (and generate_config.max_model_len with it).")


def images_of(prompts: list[Prompt]) -> list[PromptImages | None] | None:
    """The prompts' images for a rollout engine and the batch, or None when none has any."""
    images = [p.images for p in prompts]
    return images if any(i is not None for i in images) else None


class PromptLoader(Generic[Row]):
    """Batches of rows — GRPO's prompts, or the SFT trainer's examples — in a resumable order."""

    def __init__(self, prompts: list[Row], batch_size: int, seed: int, shuffle: bool = True) -> None:
        if len(prompts) < batch_size:
            raise ConfigError(f"the training split has {len(prompts)} prompts, fewer than one batch of "
                              f"global_batch_size={batch_size}; lower global_batch_size or add data.")
        self.prompts, self.batch_size, self.seed, self.shuffle = prompts, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.prompts)))
        generator = torch.Generator().manual_seed(self.seed + 7919 * self.epoch)
        return torch.randperm(len(self.prompts), generator=generator).tolist()

    def next_batch(self) -> list[Row]:
        return [self.prompts[i] for i in self.next_rows()]

    def next_rows(self) -> list[int]:
        """The next batch as indices into `prompts` (what an asynchronous run's checkpoint records of a group)."""
        if self.position + self.batch_size > len(self.prompts):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation()
        rows = self._order[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return rows

    def rewind(self, rows: list[int], batch_size: int) -> None:
        """Step back over the last len(rows) rows taken, which were taken in batches of `batch_size` and must be
        `rows`: a scheduled run's buffered prompts, handed back to be generated again by a run that resumes it
        without its schedule. One sentence if they are not (another seed, data or batch size since)."""
        per_epoch = len(self.prompts) // batch_size * batch_size
        taken = self.epoch * per_epoch + self.position - len(rows)
        if len(rows) % batch_size or taken < 0:
            raise ConfigError(f"the checkpoint's {len(rows)} buffered prompts are no whole batches of "
                              f"{batch_size} taken from this data; resume with the schedule that wrote it.")
        epoch, position = divmod(taken, per_epoch)
        for size in (batch_size, self.batch_size):  # the batches that gave them, and those that give them again
            replay = PromptLoader(self.prompts, size, self.seed, self.shuffle)
            replay.load_state_dict({"epoch": epoch, "position": position})
            given: list[int] = []
            while len(given) < len(rows):
                given += replay.next_rows()
            if given[:len(rows)] != rows:
                raise ConfigError(
                    "the checkpoint's buffered prompts are not the rows this data and seed give at its position (the "
                    "data or seed changed since); resume with the data and seed that wrote it." if size == batch_size
                    else f"global_batch_size={self.batch_size} would pass over some of the checkpoint's buffered "
                         f"prompts at the end of the epoch; resume at global_batch_size={batch_size}, the batches "
                         f"that took them.")
        self.load_state_dict({"epoch": epoch, "position": position})

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()
