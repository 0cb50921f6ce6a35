"""Rows of a raw dataset: jsonl, json (a list or {"data": [...]}) , parquet, or an HF dataset
saved with `save_to_disk` (read from its Arrow files, so the `datasets` package is not needed);
and the columns of a preprocessed prompt parquet, for the trainers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mindrl.config.errors import ConfigError


def read_rows(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the rows of `path` in file order, as dicts."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"input {path} does not exist.")
    if path.is_dir():
        yield from _read_saved_dataset(path)
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ConfigError(
                            f"{path} line {number} is not valid JSON ({err.msg}); fix or remove it.") from None
    elif path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        rows = data.get("data") if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise ConfigError(f"{path} must hold a JSON list of rows (or {{\"data\": [...]}}).")
        yield from rows
    elif path.suffix == ".parquet":
        yield from pq.read_table(path).to_pylist()
    else:
        raise ConfigError(f"input {path} has an unsupported type; use .jsonl, .json, .parquet or a directory "
                          f"written by datasets' save_to_disk.")


def _read_saved_dataset(folder: Path) -> Iterator[dict[str, Any]]:
    state = folder / "state.json"
    if not state.is_file():
        files = sorted(folder.glob("*.parquet")) + sorted(folder.glob("*.jsonl"))
        if not files:
            raise ConfigError(f"input directory {folder} has no state.json (save_to_disk), parquet or jsonl files.")
        for file in files:
            yield from read_rows(file)
        return
    for entry in json.loads(state.read_text())["_data_files"]:
        with pa.memory_map(str(folder / entry["filename"])) as source:
            yield from pa.ipc.open_stream(source).read_all().to_pylist()


def read_columns(path: str | Path, columns: tuple[str, ...]) -> dict[str, list]:
    """The named columns of a cli/preprocess_data.py parquet, each a list; one sentence if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no prompt file at {path}; run cli/preprocess_data.py for this dataset or point "
                          f"megatron_training.data_path at its output folder.")
    try:
        table = pq.read_table(path)
    except pa.ArrowException as err:
        raise ConfigError(f"{path} is not a parquet file ({err}); it must be the output of "
                          f"cli/preprocess_data.py.") from None
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ConfigError(f"{path} lacks the columns {missing}; it must be the output of cli/preprocess_data.py.")
    return {c: table.column(c).to_pylist() for c in columns}
