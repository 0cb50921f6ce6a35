"""Streaming safetensors I/O for HF checkpoints (single file or sharded with an index).

The reader hands out tensors memory-mapped from the page cache, one at a time: no copy
is made for a tensor that is only renamed, and a mapping ends when the last tensor using
it is gone, so what stays resident is what the converter still holds. File sizes are
checked against the headers up front, so a truncated shard fails before anything is
written. The writer fills shards up to a byte budget and writes each as soon as it is
full, so only one output shard is ever held.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
INDEX_FILE = "model.safetensors.index.json"


class _Entry(NamedTuple):
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of the tensor's first byte in the file


class HFWeights:
    """Lazy access to the tensors of an HF checkpoint directory, by name.

    The headers are read once, here; a tensor is then a slice of a fresh private mapping of its
    file (what safetensors' own reader does, without parsing the header again on every access).
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.folder} has no *.safetensors files; mindrl converts safetensors "
                                    f"checkpoints (save the model with safe_serialization=True).")
        self._entries: dict[str, _Entry] = {}
        self.shard_bytes: dict[str, int] = {}
        for name in files:
            path = self.folder / name
            if not path.is_file():
                raise FileNotFoundError(f"{INDEX_FILE} in {self.folder} names {name}, which is missing.")
            self.shard_bytes[name] = path.stat().st_size
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
            data_end = 8 + header_len + max((m["data_offsets"][1] for m in header.values()), default=0)
            if data_end > self.shard_bytes[name]:
                raise OSError(f"{path} is truncated: its header promises {data_end} bytes but the file has "
                              f"{self.shard_bytes[name]}; re-download or re-save the checkpoint.")
            for key, meta in header.items():
                self._entries[key] = _entry(path, key, meta, 8 + header_len)

    def names(self) -> set[str]:
        return set(self._entries)

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name].dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def get(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `name` (or only its rows [start, stop)), mapped from the file.

        Rows come with a storage of exactly their bytes, so torch.save writes them straight from
        the page cache instead of dragging the whole tensor along (or a copy being made first).
        """
        if name not in self._entries:
            raise KeyError(f"{self.folder} has no tensor {name!r}.")
        path, dtype, shape, offset = self._entries[name]
        if rows is not None:
            if not 0 <= rows[0] <= rows[1] <= shape[0]:
                raise ValueError(f"{name} has {shape[0]} rows; rows {rows[0]}:{rows[1]} are outside it.")
            offset += rows[0] * math.prod(shape[1:]) * dtype.itemsize
            shape = (rows[1] - rows[0], *shape[1:])
        mapped = torch.UntypedStorage.from_file(str(path), False, self.shard_bytes[path.name])
        storage = mapped[offset:offset + math.prod(shape) * dtype.itemsize]
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def _entry(path: Path, name: str, meta: dict, data_start: int) -> _Entry:
    """One header entry, checked: a dtype torch has, and as many bytes as the shape needs."""
    if meta["dtype"] not in DTYPES:
        raise OSError(f"{path}: {name} is stored as {meta['dtype']}, which mindrl does not convert.")
    dtype, shape = DTYPES[meta["dtype"]], tuple(meta["shape"])
    begin, end = meta["data_offsets"]
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise OSError(f"{path}: {name} has shape {list(shape)} in {meta['dtype']} but {end - begin} bytes; "
                      f"the file is damaged, so re-download or re-save the checkpoint.")
    return _Entry(path, dtype, shape, data_start + begin)


class ShardedSafetensorsWriter:
    """Writes tensors in order into `model-0000i-of-0000N.safetensors` plus the index."""

    def __init__(self, folder: str | Path, max_shard_bytes: int) -> None:
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0
        self.largest_shard_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = self.folder / f"shard-{len(self._written):05d}.tmp"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self.largest_shard_bytes = max(self.largest_shard_bytes, self._pending_bytes)
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Flush, give shards their final names and write the index; returns the shard paths."""
        if self._pending:
            self._flush()
        count = len(self._written)
        weight_map, final = {}, []
        for i, (path, names) in enumerate(self._written):
            target = self.folder / f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            path.rename(target)
            final.append(target)
            weight_map.update(dict.fromkeys(names, target.name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return final


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count → bytes."""
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "B": 1, "": 1}
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]I?B|B)?\s*", text.upper())
    if not match:
        raise ValueError(f"--max-shard-size {text!r} is not a size such as 5GB or 500MB.")
    value = int(float(match.group(1)) * units[match.group(2) or ""])
    if value <= 0:
        raise ValueError(f"--max-shard-size must be positive, got {text!r}.")
    return value
