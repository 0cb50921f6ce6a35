"""Raw question/answer rows → templated, tokenized prompt parquet files (train / test).

Output columns: `prompt` (templated text), `prompt_ids` (int32 token ids), `answer` (or, for
preference pairs, `chosen` / `rejected` and their token ids), `data_source`, `extra_info` (the
row's other columns as JSON, plus its input index) and `index`; the schema's metadata records
the template and its stop words (mindrl.data.stops). The same input and recipe give
byte-identical files: rows keep input order, the split is a seeded permutation, and nothing
time- or machine-dependent is written.
Nothing is dropped silently: prompts over `max_prompt_length` tokens are dropped and
counted, and a bad row is an error naming the row and the key unless `skip_bad_rows`.

With `image_key` the rows are image questions (mindrl.data.images): every image is decoded and its patch grid
worked out here, so a missing or unreadable image, or a prompt whose `<image>` placeholders do not match its
images, stops preprocessing at that row, before any training; `images` (the files' bytes) and `image_grid_thw`
are written beside the prompt, whose tokens hold each image's placeholders expanded to its grid.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mindrl.checkpoint.atomic import atomic_file
from mindrl.config.errors import ConfigError
from mindrl.data.images import (
    IMAGE_PAD,
    MAX_PIXELS,
    MIN_PIXELS,
    BadImage,
    ImageSizing,
    decode_image,
    expand_image_pads,
    image_bytes,
    image_prompt,
    sizing_record,
    vision_token_ids,
)
from mindrl.data.preference import PAIR_KEYS, read_pair, render_prompt, response_ids
from mindrl.data.readers import read_rows
from mindrl.data.shapes import generate_shape_problems
from mindrl.data.stops import template_record
from mindrl.data.synthetic import generate_problems
from mindrl.data.templates import get_template
from mindrl.data.tokenizer import load_tokenizer
from mindrl.tools.config import read_tool_config

MAP_KEYS = ("prompt", "query", "answer", "system")
SCHEMA = pa.schema([("index", pa.int64()), ("prompt", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
                    ("answer", pa.string()), ("data_source", pa.string()), ("extra_info", pa.string())])
#: a preference pair's row (`is_pairwise_dataset`): the responses' text and tokens (the tokenizer's EOS last)
PAIR_SCHEMA = pa.schema([("index", pa.int64()), ("prompt", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
                         ("chosen", pa.string()), ("chosen_ids", pa.list_(pa.int32())), ("rejected", pa.string()),
                         ("rejected_ids", pa.list_(pa.int32())), ("data_source", pa.string()),
                         ("extra_info", pa.string())])
#: an image question's row: the prompt's images (the files' bytes) and their (t, h, w) patch grids
IMAGE_SCHEMA = SCHEMA.append(pa.field("images", pa.list_(pa.binary()))).append(
    pa.field("image_grid_thw", pa.list_(pa.list_(pa.int32()))))


@dataclass(frozen=True)
class PreprocessConfig:
    """A preprocessing recipe (configs/datasets/<name>.yaml)."""

    output_dir: str
    tokenizer_name_or_path: str
    input: str | None = None
    #: instead of `input`: {kind: arithmetic|word|mixed, num_samples: N, seed: S}
    generator: dict | None = None
    prompt_type: str = "qwen_r1"
    prompt_type_path: str | None = None
    #: output field → input column; `response` is accepted as MindSpeed-RL's name for `answer`. Default:
    #: {prompt: prompt, answer: answer}; with is_pairwise_dataset each of prompt, chosen, rejected to itself
    map_keys: dict | None = None
    #: rows are preference pairs (prompt, chosen, rejected) for the DPO stage (MindSpeed-LLM's key)
    is_pairwise_dataset: bool = False
    data_source: str | None = None
    max_prompt_length: int = 1024
    test_fraction: float = 0.0
    #: drop training rows whose prompt is also a test prompt, so the test split is text never trained on
    unseen_test_prompts: bool = False
    seed: int = 1234
    skip_bad_rows: bool = False
    #: the column holding each row's images (EasyR1's `images`); set: rows are image questions
    image_key: str | None = None
    #: an image is resized (keeping its aspect) so its pixel count lies in [min_pixels, max_pixels]
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    #: a tool config (docs/tools.md): its tools are announced in every prompt's system text, in the template's
    #: tools block (format_tools), as a multi-turn run with that rl_config.tool_config_path needs
    tool_config_path: str | None = None

    def __post_init__(self) -> None:
        if (self.input is None) == (self.generator is None):
            raise ConfigError("give exactly one of input (a data file or directory) and generator.")
        pairwise = self.is_pairwise_dataset
        known, required = (PAIR_KEYS, ("chosen", "rejected")) if pairwise else (MAP_KEYS, ("prompt", "answer"))
        keys = dict(self.map_keys or {name: name for name in ("prompt", *required)})
        if not pairwise and "response" in keys:
            if "answer" in keys:
                raise ConfigError("map_keys has both response and answer; they are the same field, keep one.")
            keys["answer"] = keys.pop("response")
        unknown = set(keys) - set(known)
        if unknown:
            raise ConfigError(f"map_keys has unknown fields {sorted(unknown)}{' for a pairwise dataset' * pairwise}; "
                              f"use {', '.join(known)}{'' if pairwise else ' (or response)'}.")
        if not all(keys.get(name) for name in required):
            raise ConfigError(f"map_keys must name the input columns for {required[0]} and {required[1]}.")
        object.__setattr__(self, "map_keys", {k: v for k, v in keys.items() if v})
        if not 0.0 <= self.test_fraction < 1.0:
            raise ConfigError(f"test_fraction must be in [0, 1), got {self.test_fraction}.")
        if self.unseen_test_prompts and not self.test_fraction:
            raise ConfigError("unseen_test_prompts keeps test prompts out of training, but test_fraction is 0 so "
                              "there is no test split; set test_fraction > 0 or drop unseen_test_prompts.")
        if self.max_prompt_length < 1:
            raise ConfigError(f"max_prompt_length must be positive, got {self.max_prompt_length}.")
        if self.image_key is None and _generates_images(self.generator):
            object.__setattr__(self, "image_key", "images")
        if self.image_key is not None and pairwise:
            raise ConfigError("image_key with is_pairwise_dataset: image preference pairs are not built; drop one.")
        if self.tool_config_path is not None and pairwise:
            raise ConfigError("tool_config_path announces a multi-turn rollout's tools, which preference pairs "
                              "(is_pairwise_dataset) do not run; drop one.")
        ImageSizing(self.min_pixels, self.max_pixels)

    @property
    def sizing(self) -> ImageSizing:
        return ImageSizing(self.min_pixels, self.max_pixels)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PreprocessConfig:
        known = {f.name for f in fields(cls)}
        values = {k.replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown preprocessing keys {unknown}; known: {', '.join(sorted(known))}.")
        return cls(**values)


@dataclass
class PreprocessReport:
    rows_read: int = 0
    kept: int = 0
    dropped_too_long: int = 0
    dropped_seen_in_test: int = 0
    skipped_bad: int = 0
    train: int = 0
    test: int = 0
    longest_prompt: int = 0
    bad_examples: list[str] = field(default_factory=list)


def _field(row: Any, number: int, key: str, column: str, source: str, required: bool = True) -> str | None:
    if not isinstance(row, dict):
        raise _BadRow(f"{source} row {number} is a {type(row).__name__}, not an object with columns")
    if column not in row or row[column] is None:
        if not required:
            return None
        raise _BadRow(f"{source} row {number} has no {column!r} (mapped to {key})")
    value = row[column]
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise _BadRow(f"{source} row {number}: {column!r} (mapped to {key}) is a {type(value).__name__}, not text")
    text = str(value)
    if required and not text.strip():
        raise _BadRow(f"{source} row {number}: {column!r} (mapped to {key}) is empty")
    return text


class _BadRow(Exception):
    pass


def _generates_images(generator: dict | None) -> bool:
    return generator is not None and str(generator.get("kind", "")).startswith("shapes")


def _source_rows(cfg: PreprocessConfig) -> tuple[Iterable[Any], str]:
    if cfg.generator is not None:
        spec = dict(cfg.generator)
        kind, count, seed = spec.get("kind", "mixed"), int(spec.get("num_samples", 1000)), int(spec.get("seed", 0))
        if _generates_images(spec):
            task = kind.removeprefix("shapes").removeprefix("_") or "mixed"
            return generate_shape_problems(task, count, seed), f"generator:{kind}"
        return generate_problems(kind, count, seed), f"generator:{kind}"
    return read_rows(cfg.input), Path(cfg.input).name


class _Images:
    """What an image question's record needs besides the text: the sizing, the files' folder, the pad's id."""

    def __init__(self, cfg: PreprocessConfig, tokenizer: Any) -> None:
        self.key, self.sizing = cfg.image_key, cfg.sizing
        self.folder = Path(cfg.input).parent if cfg.input else None
        self.pad_id = vision_token_ids(tokenizer)[IMAGE_PAD]

    def of(self, row: Any, where: str) -> tuple[list[bytes], list[list[int]]]:
        """The row's images as stored and their grids; a missing or unreadable one is a bad row."""
        values = row.get(self.key) if isinstance(row, dict) else None
        if values is None:
            raise _BadRow(f"{where} has no {self.key!r} (image_key)")
        values = list(values) if isinstance(values, list | tuple) else [values]
        if not values:
            raise _BadRow(f"{where}: {self.key!r} (image_key) holds no images")
        files, grids = [], []
        for number, value in enumerate(values):
            try:
                files.append(image_bytes(value, self.folder))
                grids.append(list(self.sizing.grid(decode_image(files[-1]))))
            except BadImage as bad:
                raise _BadRow(f"{where}: image {number} of {self.key!r}: {bad}") from None
        return files, grids


def _prompt_record(row: Any, number: int, source: str, keys: dict, template: Any, tokenizer: Any,
                   images: _Images | None = None, tools: list[dict] | tuple = ()) -> dict:
    prompt = _field(row, number, "prompt", keys["prompt"], source)
    if "query" in keys:
        query = _field(row, number, "query", keys["query"], source, required=False)
        prompt = f"{prompt}\n{query}" if query else prompt
    answer = _field(row, number, "answer", keys["answer"], source)
    system = _field(row, number, "system", keys["system"], source, required=False) if "system" in keys else None
    extra: dict[str, Any] = {}
    if images is not None:
        where = f"{source} row {number}"
        files, grids = images.of(row, where)
        try:
            prompt = image_prompt(prompt, len(files), where)
        except BadImage as bad:
            raise _BadRow(str(bad)) from None
        extra = {"images": files, "image_grid_thw": grids}
    text = template.render(prompt, system, tokenizer, tools)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if images is not None:
        ids = expand_image_pads(ids, extra["image_grid_thw"], images.pad_id)
    return {"prompt": text, "prompt_ids": ids, "answer": answer, **extra}


def _pair_record(row: Any, number: int, source: str, keys: dict, template: Any, tokenizer: Any,
                 images: None = None, tools: tuple = ()) -> dict:
    where = f"{source} row {number}"
    if not isinstance(row, dict):
        raise _BadRow(f"{where} is a {type(row).__name__}, not an object with columns")
    try:
        pair = read_pair(row, keys, where)
        text = render_prompt(pair, template, tokenizer, where)
    except ConfigError as err:
        raise _BadRow(str(err)) from None
    return {"prompt": text, "prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"],
            "chosen": pair.chosen, "chosen_ids": response_ids(pair.chosen, tokenizer), "rejected": pair.rejected,
            "rejected_ids": response_ids(pair.rejected, tokenizer)}


def preprocess(cfg: PreprocessConfig) -> PreprocessReport:
    """Write `train.parquet` (and `test.parquet` when test_fraction > 0) into cfg.output_dir."""
    template = get_template(cfg.prompt_type, cfg.prompt_type_path)
    tokenizer = load_tokenizer(cfg.tokenizer_name_or_path)
    if cfg.is_pairwise_dataset and tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer at {cfg.tokenizer_name_or_path} has no EOS token; preference responses "
                          f"must end with the token generation stops on.")
    rows, source = _source_rows(cfg)
    data_source = cfg.data_source or source
    keys = cfg.map_keys
    used = set(keys.values()) | {cfg.image_key}
    make_record = _pair_record if cfg.is_pairwise_dataset else _prompt_record
    images = _Images(cfg, tokenizer) if cfg.image_key else None
    tools = [tool.schema for tool in read_tool_config(cfg.tool_config_path)] if cfg.tool_config_path else []
    if tools:  # a template that cannot announce them is one sentence before any row
        template.render("", None, tokenizer, tools)
    report = PreprocessReport()
    records = []
    for number, row in enumerate(rows):
        report.rows_read += 1
        try:
            record = make_record(row, number, source, keys, template, tokenizer, images, tools)
        except _BadRow as bad:
            if not cfg.skip_bad_rows:
                raise ConfigError(f"{bad}; fix the data, point map_keys at the right column, or set "
                                  f"skip_bad_rows: true to skip and count such rows.") from None
            report.skipped_bad += 1
            if len(report.bad_examples) < 5:
                report.bad_examples.append(str(bad))
            continue
        if len(record["prompt_ids"]) > cfg.max_prompt_length:
            report.dropped_too_long += 1
            continue
        report.longest_prompt = max(report.longest_prompt, len(record["prompt_ids"]))
        extra = {k: v for k, v in row.items() if k not in used}
        records.append({"index": number, **record, "data_source": data_source,
                        "extra_info": json.dumps(extra, sort_keys=True, ensure_ascii=False, default=str)})
    report.kept = len(records)
    if not records:
        raise ConfigError(f"no usable rows in {source} ({report.rows_read} read, {report.dropped_too_long} over "
                          f"max_prompt_length={cfg.max_prompt_length}, {report.skipped_bad} bad); nothing written.")

    n_test = round(cfg.test_fraction * len(records))
    test_positions = set(np.random.default_rng(cfg.seed).permutation(len(records))[:n_test].tolist())
    splits = {"train": [r for i, r in enumerate(records) if i not in test_positions],
              "test": [r for i, r in enumerate(records) if i in test_positions]}
    if cfg.unseen_test_prompts:
        test_prompts = {r["prompt"] for r in splits["test"]}
        kept = [r for r in splits["train"] if r["prompt"] not in test_prompts]
        report.dropped_seen_in_test = len(splits["train"]) - len(kept)
        splits["train"] = kept
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, split in splits.items():
        setattr(report, name, len(split))
        if split:
            schema = PAIR_SCHEMA if cfg.is_pairwise_dataset else IMAGE_SCHEMA if images else SCHEMA
            metadata = template_record(cfg.prompt_type, template.stop_words)
            if images:
                metadata.update(sizing_record(cfg.sizing))
            _write_parquet(split, out / f"{name}.parquet", schema, metadata)
        else:
            (out / f"{name}.parquet").unlink(missing_ok=True)  # a stale split from an earlier run
    return report


def _write_parquet(records: list[dict], path: Path, schema: pa.Schema, metadata: dict[bytes, bytes]) -> None:
    """Written beside the target and renamed, so a reader never sees half a file; `metadata` goes into the
    schema (the template, whose stop words the trainers read)."""
    table = pa.Table.from_pylist(records, schema=schema.with_metadata(metadata))
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
