"""The non-weight files of an HF checkpoint (config, generation config, tokenizer, template)."""

from __future__ import annotations

import shutil
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
ASSETS_DIR = "hf_assets"


def copy_assets(source: str | Path, target: str | Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy every top-level file of `source` that is not a weight file; returns their names."""
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(source.iterdir()):
        if (path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and path.name not in WEIGHT_INDEXES
                and path.name not in skip):
            shutil.copy2(path, target / path.name)
            copied.append(path.name)
    return copied
