"""Images of a vision-language dataset: decoding a row's images, the processor's resize and patches, and the
image placeholders of a prompt.

A raw row keeps its images in one column (`image_key`, EasyR1's `images`): each an encoded image as bytes, HF
datasets' `{"bytes": ..., "path": ...}`, or a path (relative to the data file's folder). Its prompt marks where
each goes with `<image>`; the prompt written for training holds `<|vision_start|>`, one `<|image_pad|>` per merged
patch of that image, and `<|vision_end|>` instead. The pixels the model sees are the ones HF's Qwen2-VL image
processor makes (its PIL backend: bicubic resize to multiples of 28 within min/max pixels, CLIP normalisation),
so the trainer and the rollout engines see the same numbers.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from mindrl.config.errors import ConfigError

PLACEHOLDER = "<image>"
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, "<|video_pad|>")
#: Qwen2.5-VL's patch side and merge; the processor's grids and the placeholder counts follow from them
PATCH_SIZE, MERGE_SIZE = 14, 2
#: the processor's defaults (Qwen2.5-VL's published preprocessor_config.json)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280


class BadImage(ValueError):
    """A row's image that cannot be used; the message names the image."""


def image_bytes(value: Any, folder: Path | None = None) -> bytes:
    """The encoded image a column value holds: bytes, {"bytes", "path"}, or a path (relative to `folder`), read
    once: preprocessing decodes these bytes and stores them as they are."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str) and value:
        path = Path(value)
        path = path if path.is_absolute() or folder is None else folder / path
        if not path.is_file():
            raise BadImage(f"image file {value} does not exist")
        return path.read_bytes()
    raise BadImage(f"an image must be encoded bytes, {{'bytes': ...}} or a path, got {type(value).__name__}")


def decode_image(data: bytes) -> Image.Image:
    """An RGB PIL image from an encoded image's bytes."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise BadImage(f"image cannot be decoded ({err})") from None


@dataclass(frozen=True)
class ImageSizing:
    """Where an image's pixel count must lie after resizing (EasyR1's min_pixels / max_pixels)."""

    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS

    def __post_init__(self) -> None:
        factor = (PATCH_SIZE * MERGE_SIZE) ** 2
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ConfigError(f"min_pixels={self.min_pixels} and max_pixels={self.max_pixels} must satisfy "
                              f"0 < min_pixels <= max_pixels.")
        if self.max_pixels < factor:
            raise ConfigError(f"max_pixels={self.max_pixels} is below one merged patch ({factor} pixels); raise it.")

    def grid(self, image: Image.Image) -> tuple[int, int, int]:
        """The (t, h, w) patch grid the processor makes of `image`."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        try:
            height, width = smart_resize(image.height, image.width, PATCH_SIZE * MERGE_SIZE, self.min_pixels,
                                         self.max_pixels)
        except ValueError as err:  # an aspect ratio over 200
            raise BadImage(str(err)) from None
        return 1, height // PATCH_SIZE, width // PATCH_SIZE

    def pixels(self, images: Sequence[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [patches, 1176], image_grid_thw [images, 3]) of `images`, as HF's processor makes them."""
        out = _processor(self.min_pixels, self.max_pixels)(images=list(images), return_tensors="np")
        return (torch.from_numpy(np.ascontiguousarray(out["pixel_values"], dtype=np.float32)),
                torch.from_numpy(out["image_grid_thw"].astype(np.int64)))


@cache
def _processor(min_pixels: int, max_pixels: int) -> Any:
    """HF's PIL Qwen2-VL image processor for one sizing, built once: batches of every step use it."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=PATCH_SIZE,
                                    merge_size=MERGE_SIZE)


#: the parquet schema-metadata key under which preprocessing records how it sized the images
SIZING_METADATA = b"mindrl.images"


def sizing_record(sizing: ImageSizing) -> dict[bytes, bytes]:
    return {SIZING_METADATA: json.dumps({"min_pixels": sizing.min_pixels, "max_pixels": sizing.max_pixels,
                                         "patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE}).encode()}


def recorded_sizing(metadata: dict[bytes, bytes] | None) -> ImageSizing | None:
    """The sizing a preprocessed parquet's images were measured with; None for a text-only one."""
    if not metadata or SIZING_METADATA not in metadata:
        return None
    values = json.loads(metadata[SIZING_METADATA])
    return ImageSizing(values["min_pixels"], values["max_pixels"])


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images as a rollout engine gets them: the files' bytes and how to size them."""

    files: tuple[bytes, ...]
    sizing: ImageSizing

    def decoded(self) -> list[Image.Image]:
        return [decode_image(f) for f in self.files]

    def pixels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [patches, 1176], image_grid_thw [images, 3]) of the prompt's images."""
        return self.sizing.pixels(self.decoded())

    def grids(self) -> torch.Tensor:
        """image_grid_thw [images, 3] alone: what a stage that never sees the pixels needs for the positions."""
        return torch.tensor([self.sizing.grid(image) for image in self.decoded()], dtype=torch.long)


def read_images(path: str | Path) -> list[PromptImages] | None:
    """Each row's images of a preprocessed parquet (sized as its metadata records); None for text-only data."""
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    if "images" not in schema.names:
        return None
    sizing = recorded_sizing(schema.metadata)
    if sizing is None:
        raise ConfigError(f"{path} has an images column but no record of how its images were sized; preprocess it "
                          f"with cli/preprocess_data.py (image_key).")
    files = pq.read_table(path, columns=["images"]).column("images").to_pylist()
    return [PromptImages(tuple(row), sizing) for row in files]


def check_image_tokens(tokenizer: Any, vision: Any, where: str) -> None:
    """The tokenizer's vision markers must be the model's: a prompt's placeholders are the ids the model
    replaces by image features."""
    ids = vision_token_ids(tokenizer)
    expected = {VISION_START: vision.vision_start_token_id, VISION_END: vision.vision_end_token_id,
                IMAGE_PAD: vision.image_token_id}
    wrong = [token for token, i in expected.items() if ids[token] != i]
    if wrong:
        raise ConfigError(f"{where}: the tokenizer gives {wrong[0]} id {ids[wrong[0]]} but the model's vision "
                          f"config says {expected[wrong[0]]}; use the model's own tokenizer.")


def one_pad_per_image(ids: Sequence[int], image_pad: int) -> list[int]:
    """A prompt with each run of image placeholders cut to one (vLLM expands each to its image's grid)."""
    return [t for i, t in enumerate(ids) if t != image_pad or i == 0 or ids[i - 1] != image_pad]


def tokens_of(grid: Sequence[int]) -> int:
    """Language-model tokens of an image of patch grid (t, h, w)."""
    t, h, w = grid
    return t * h * w // MERGE_SIZE ** 2


def vision_token_ids(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's ids of the vision markers, or one sentence saying it lacks them."""
    vocab = tokenizer.get_vocab()
    missing = [token for token in VISION_TOKENS if token not in vocab]
    if missing:
        raise ConfigError(f"the tokenizer has no {missing[0]} token, so it cannot mark images; use a vision-language "
                          f"model's tokenizer (Qwen2.5-VL's, or data/tiny_vl_tokenizer).")
    return {token: vocab[token] for token in VISION_TOKENS}


def image_prompt(text: str, images: int, where: str) -> str:
    """`text` with each `<image>` replaced by the vision markers around one image placeholder."""
    found = text.count(PLACEHOLDER)
    if found != images:
        raise BadImage(f"{where} has {found} {PLACEHOLDER} placeholders but {images} images; give each image one "
                       f"placeholder where it goes in the prompt")
    return text.replace(PLACEHOLDER, VISION_START + IMAGE_PAD + VISION_END)


def expand_image_pads(ids: Sequence[int], grids: Sequence[Sequence[int]], image_pad: int) -> list[int]:
    """Token ids with each image's one placeholder repeated to that image's token count."""
    out, image = [], 0
    for token in ids:
        if token == image_pad:
            if image == len(grids):
                raise BadImage(f"the prompt's tokens hold more image placeholders than its {len(grids)} images")
            out.extend([image_pad] * tokens_of(grids[image]))
            image += 1
        else:
            out.append(token)
    if image != len(grids):
        raise BadImage(f"the prompt's tokens hold {image} image placeholders for {len(grids)} images")
    return out
