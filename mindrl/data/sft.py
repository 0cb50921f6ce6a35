"""Supervised fine-tuning examples: a preprocessed prompt and the response to teach for it.

The response is `response_format` filled from the row: `{answer}` and every field of the
row's `extra_info` (the input's other columns, e.g. a GSM8K `{solution}`), so one prompt
parquet serves both SFT and GRPO. It is tokenized without special tokens and ends with the
tokenizer's EOS, which is what the rollout engine stops on — a model that never saw EOS
in SFT runs every GRPO response to its length limit. Examples longer than `seq_length` are
dropped and counted, never cut: a cut response would teach the model to stop mid-answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from string import Formatter
from typing import Any

import torch

from mindrl.config import ConfigError
from mindrl.data.images import PromptImages, read_images
from mindrl.data.readers import read_columns
from mindrl.models.vision import rows_of_images

COLUMNS = ("prompt_ids", "answer", "extra_info")


@dataclass(frozen=True)
class SFTExample:
    prompt_ids: list[int]
    response_ids: list[int]
    #: an image question's images (its prompt ids hold their placeholders)
    images: PromptImages | None = None


def _fields(row_answer: str, extra_info: str | None) -> dict[str, Any]:
    extra = json.loads(extra_info) if extra_info else {}
    return {**(extra if isinstance(extra, dict) else {}), "answer": row_answer}


def read_sft_examples(path: str | Path, tokenizer: Any, response_format: str,
                      seq_length: int) -> tuple[list[SFTExample], int]:
    """The examples of a cli/preprocess_data.py parquet that fit `seq_length`, and how many did not."""
    columns = read_columns(path, COLUMNS)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(f"the tokenizer at {tokenizer.name_or_path} has no EOS token; SFT responses must end with "
                          f"the token generation stops on.")
    wanted = [name for _, name, _, _ in Formatter().parse(response_format) if name]
    images = read_images(path) or [None] * len(columns["prompt_ids"])
    examples, too_long = [], 0
    for number, (ids, answer, extra_info, image) in enumerate(zip(*columns.values(), images, strict=True)):
        fields = _fields(str(answer), extra_info)
        absent = [name for name in wanted if name not in fields]
        if absent:
            raise ConfigError(f"sft_config.response_format names {absent}, which row {number} of {path} lacks (it "
                              f"has {sorted(fields)}); use those fields.")
        response = [*tokenizer.encode(response_format.format(**fields), add_special_tokens=False), eos]
        if len(ids) + len(response) > seq_length:
            too_long += 1
            continue
        examples.append(SFTExample(list(ids), response, image))
    if not examples:
        raise ConfigError(f"every example of {path} is longer than seq_length={seq_length} tokens; raise seq_length.")
    return examples, too_long


def sft_batch(examples: list[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded `tokens` and the `loss_mask` of the worker's convention: 1 at position t when
    tokens[t + 1] is a response token (the EOS included), 0 on the prompt (its image tokens too) and the
    padding; with images, each row's as `pixel_values` and `image_grid_thw`."""
    width = max(len(e.prompt_ids) + len(e.response_ids) for e in examples)
    tokens = torch.full((len(examples), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(examples), width)
    for row, example in enumerate(examples):
        ids = example.prompt_ids + example.response_ids
        tokens[row, :len(ids)] = torch.tensor(ids)
        loss_mask[row, len(example.prompt_ids) - 1:len(ids) - 1] = 1.0
    batch = {"tokens": tokens, "loss_mask": loss_mask}
    if any(e.images is not None for e in examples):
        batch["pixel_values"], batch["image_grid_thw"] = rows_of_images(
            [e.images.pixels() if e.images is not None else None for e in examples])
    return batch
