"""A MindSpeed-RL recipe as the mindrl trainer config it becomes, with every key it loses and why.

MindSpeed-RL's recipes carry keys that choose Ascend kernels or behaviour mindrl fixes (`use_flash_attn`,
`blocking`, …). mindrl's own loaders refuse such keys, so that a key which would do nothing never looks
set; importing a recipe drops them instead, names each with its reason, and writes the file that mindrl
runs without them: the recipe's sections as given (its model inline, so no model file is needed beside
it), minus the dropped keys. Loading that file gives the same configuration as loading the recipe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindrl.config.errors import ConfigError
from mindrl.config.keys import KeyNote, unsupported_keys_message
from mindrl.trainer.grpo_config import TrainerConfig
from mindrl.trainer.megatron import STAGES


@dataclass(frozen=True)
class ImportedRecipe:
    """What mindrl runs for a recipe (`cfg`, and the same as a file: `data`), and what it left out."""

    #: a TrainerConfig, or a DPO or SFT recipe's StageConfig
    cfg: TrainerConfig | Any
    data: dict[str, Any]
    dropped: tuple[KeyNote, ...]

    @property
    def command(self) -> str:
        return STAGES[self.cfg.stage]

    def report(self, written: Path | None = None) -> str:
        """The kept keys per section, each dropped key with its reason, the notices, and how to run it."""
        lines = []
        for section, values in self.data.items():
            if section == "model":
                lines.append(f"model: {', '.join(values)} (inline)")
            elif isinstance(values, dict):
                lines.append(f"{section}: {len(values)} keys kept: {', '.join(values)}")
        if self.dropped:
            lines.append(f"dropped ({len(self.dropped)}):")
            lines.extend(f"  {note.sentence}" for note in self.dropped)
        lines.extend(f"notice: {notice}" for notice in self.cfg.notices)
        if written is not None:
            lines.append(f"wrote {written}; run it with: python {self.command} --config-dir {written.parent} "
                         f"--config-name {written.stem}")
        return "\n".join(lines)


def import_recipe(path: str | Path, overrides: Sequence[str] = (),
                  transform: Callable[[dict], dict] | None = None) -> ImportedRecipe:
    """The recipe at `path` (its model/ folder beside it) with Hydra `overrides`, and `transform` (mindrl.trainer.
    shrink's, say) applied to its sections before it is built; raises ConfigError where mindrl cannot run it (a
    model family or a layout it does not build, a feature key it does not take, a typo), naming what stops it."""
    from mindrl.trainer.config import read_mindspeed_recipe

    data, cfg, notes = read_mindspeed_recipe(Path(path), overrides, transform)
    if refused := [note for note in notes if not note.droppable]:
        raise ConfigError(unsupported_keys_message(refused))
    for note in notes:
        where = data
        for part in filter(None, note.section.split(".")):  # profiler_config.integrated: a section inside one
            where = where.get(part) or {}
        for spelling in [key for key in where if str(key).replace("-", "_") == note.key]:
            where.pop(spelling)
    return ImportedRecipe(cfg, {section: values for section, values in data.items() if values is not None},
                          tuple(notes))
