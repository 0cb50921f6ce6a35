"""Image questions: the synthetic shape task's images show their answers, preprocessing carries the images and
expands their placeholders, and a bad image row is one sentence naming it before anything is written."""

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from mindrl.config import ConfigError
from mindrl.data.images import IMAGE_PAD, ImageSizing, decode_image, recorded_sizing, tokens_of, vision_token_ids
from mindrl.data.preprocess import PreprocessConfig, preprocess
from mindrl.data.shapes import COLOURS, generate_shape_problems
from mindrl.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def vl_tokenizer(tmp_path_factory):
    from cli.build_tiny_tokenizer import main

    out = tmp_path_factory.mktemp("tok") / "vl"
    assert main(["--out", str(out), "--task", "shapes", "--vision-tokens"]) == 0
    return out


def _pixels_of(image: Image.Image, colour: tuple[int, int, int]) -> np.ndarray:
    return (np.asarray(image) == np.array(colour)).all(-1)


def test_the_shape_images_show_their_answers():
    rows = generate_shape_problems("mixed", 60, seed=4)
    assert rows == generate_shape_problems("mixed", 60, seed=4)  # the same bytes for the same seed
    assert {r["kind"] for r in rows} == {"count", "compare", "length"}
    for row in rows:
        image = decode_image(row["images"][0])
        assert image.size == (112, 112) and row["problem"].startswith("<image>")
        if row["kind"] == "length":  # the bar's coloured columns span answer cells of 14 pixels, less 4
            columns = sum(_pixels_of(image, c).any(0).sum() for c in COLOURS.values())
            assert columns == int(row["answer"]) * 14 - 3, row["problem"]
        if row["kind"] == "count":  # each shape fills one cell of the 4 x 4 grid: count the cells not white
            assert _cells((np.asarray(image) != 255).any(-1)) == int(row["answer"]), row["problem"]
        if row["kind"] == "compare":
            words = row["problem"].split()
            more, fewer = words[3], words[6]
            cells = {c: _cells(_pixels_of(image, COLOURS[c])) for c in (more, fewer)}
            assert cells[more] - cells[fewer] == int(row["answer"])


def _cells(mask: np.ndarray) -> int:
    """Shapes drawn in the 4 x 4 grid of 28-pixel cells: cells holding any of the colour."""
    return sum(bool(mask[r * 28:(r + 1) * 28, c * 28:(c + 1) * 28].any()) for r in range(4) for c in range(4))


def test_the_tiny_tokenizer_ends_with_the_vision_markers_tiny_qwen25_vl_expects(vl_tokenizer):
    from mindrl.config import load_model_arch

    vision = load_model_arch("tiny_qwen25_vl").vision
    ids = vision_token_ids(load_tokenizer(vl_tokenizer))
    assert [ids["<|vision_start|>"], ids["<|vision_end|>"], ids["<|image_pad|>"], ids["<|video_pad|>"]] == [
        vision.vision_start_token_id, vision.vision_end_token_id, vision.image_token_id, vision.video_token_id]


def test_sizing_gives_the_grid_of_hfs_processor():
    sizing = ImageSizing(min_pixels=56 * 56, max_pixels=28 * 28 * 30)
    images = [Image.new("RGB", size) for size in ((112, 112), (300, 90), (40, 500))]
    pixels, grids = sizing.pixels(images)
    assert [list(sizing.grid(im)) for im in images] == grids.tolist()
    assert pixels.shape == (int(grids.prod(-1).sum()), 3 * 2 * 14 * 14) and pixels.dtype == torch.float32
    assert all(t * h * w // 4 <= 30 for t, h, w in grids.tolist())  # max_pixels holds


def _cfg(tmp_path, tokenizer, **overrides) -> PreprocessConfig:
    values = dict(output_dir=str(tmp_path / "out"), tokenizer_name_or_path=str(tokenizer), prompt_type="tokenizer",
                  map_keys={"prompt": "problem", "answer": "answer"}, image_key="images", min_pixels=12544,
                  max_pixels=12544)
    values.update(overrides)
    return PreprocessConfig(**values)


def test_preprocessing_carries_the_images_and_expands_their_placeholders(tmp_path, vl_tokenizer):
    folder = tmp_path / "raw"
    (folder / "img").mkdir(parents=True)
    Image.new("RGB", (224, 112), (9, 9, 9)).save(folder / "img" / "wide.png")
    square = io.BytesIO()
    Image.new("RGB", (112, 112), (200, 0, 0)).save(square, format="PNG")
    wide = {"bytes": None, "path": "img/wide.png"}  # HF datasets' Image feature: a path beside the data, or bytes
    rows = [{"images": [wide], "problem": "<image>How wide?", "answer": "2"},
            {"images": [{"bytes": square.getvalue(), "path": None}, wide],
             "problem": "Compare <image> and <image>.", "answer": "1"}]
    pq.write_table(pa.Table.from_pylist(rows), folder / "data.parquet")
    report = preprocess(_cfg(tmp_path, vl_tokenizer, input=str(folder / "data.parquet")))
    assert report.kept == 2
    table = pq.read_table(tmp_path / "out" / "train.parquet")
    out = table.to_pylist()
    pad = vision_token_ids(load_tokenizer(vl_tokenizer))[IMAGE_PAD]
    # 224 x 112 is 25088 pixels: scaled by 1/√2 and floored to multiples of 28, 140 x 56, 10 x 4 patches
    assert out[0]["image_grid_thw"] == [[1, 4, 10]] and out[1]["image_grid_thw"] == [[1, 8, 8], [1, 4, 10]]
    for row in out:
        assert row["prompt_ids"].count(pad) == sum(tokens_of(g) for g in row["image_grid_thw"])
    assert out[1]["images"] == [square.getvalue(), (folder / "img" / "wide.png").read_bytes()]
    assert "images" not in json.loads(out[1]["extra_info"])
    assert recorded_sizing(table.schema.metadata) == ImageSizing(12544, 12544)


@pytest.mark.parametrize("row, message", [
    ({"problem": "<image>Q", "answer": "1"}, r"row 0 has no 'images' \(image_key\)"),
    ({"images": ["missing.png"], "problem": "<image>Q", "answer": "1"},
     r"row 0: image 0 of 'images': image file missing.png does not exist"),
    ({"images": [b"not an image"], "problem": "<image>Q", "answer": "1"},
     r"row 0: image 0 of 'images': image cannot be decoded"),
    ({"images": [], "problem": "<image>Q", "answer": "1"}, r"row 0: 'images' \(image_key\) holds no images"),
    ({"images": ["ok.png"], "problem": "<image><image>Q", "answer": "1"},
     r"row 0 has 2 <image> placeholders but 1 images"),
    ({"images": ["ok.png", "ok.png"], "problem": "Q", "answer": "1"}, r"row 0 has 0 <image> placeholders but 2"),
])
def test_a_bad_image_row_is_one_sentence_naming_it_and_writes_nothing(tmp_path, vl_tokenizer, row, message):
    folder = tmp_path / "raw"
    folder.mkdir()
    Image.new("RGB", (56, 56)).save(folder / "ok.png")
    pq.write_table(pa.Table.from_pylist([row]), folder / "data.parquet")
    cfg = _cfg(tmp_path, vl_tokenizer, input=str(folder / "data.parquet"))
    with pytest.raises(ConfigError, match=r"^data\.parquet " + message):
        preprocess(cfg)
    assert not (tmp_path / "out" / "train.parquet").exists()
    as_bytes = any(isinstance(i, bytes) for i in row.get("images", []))  # one column holds one type
    image = (folder / "ok.png").read_bytes() if as_bytes else "ok.png"
    good = {"images": [image], "problem": "<image>Q", "answer": "1"}
    pq.write_table(pa.Table.from_pylist([good, row]), folder / "data.parquet")  # the columns of the first row
    report = preprocess(_cfg(tmp_path, vl_tokenizer, input=str(folder / "data.parquet"), skip_bad_rows=True))
    assert (report.kept, report.skipped_bad) == (1, 1)


def test_image_keys_are_checked_before_any_work(tmp_path, vl_tokenizer):
    with pytest.raises(ConfigError, match="min_pixels=100 and max_pixels=50 must satisfy"):
        _cfg(tmp_path, vl_tokenizer, input="x.jsonl", min_pixels=100, max_pixels=50)
    text_tokenizer = tmp_path / "text_tok"
    from cli.build_tiny_tokenizer import main

    main(["--out", str(text_tokenizer)])
    with pytest.raises(ConfigError, match=r"^the tokenizer has no <\|vision_start\|> token"):
        preprocess(_cfg(tmp_path, text_tokenizer, generator={"kind": "shapes", "num_samples": 4}))
