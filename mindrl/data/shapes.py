"""An offline image task: shapes drawn with PIL, with questions a rule can check.

Three kinds, each answered by one small integer, so `The answer is N.` (SFT) and exact-match verifiers grade
them: how many shapes an image holds, how many more shapes of one colour than of another, and how many cells long
a bar on a grid is. Every shape sits in one 28-pixel cell, which is one language-model token. The rows have EasyR1's
layout: `images` (a list of PNG bytes), `problem` with an `<image>` placeholder, `answer`. The same seed gives the
same bytes.
"""

from __future__ import annotations

import io
import random

from PIL import Image, ImageDraw

SIZE = 112  # pixels across: four merged 28-pixel patches, 16 language-model tokens at the default sizing
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "blue": (40, 70, 220), "green": (40, 160, 60)}


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _draw(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour)


def _scatter(rng: random.Random, items: list[tuple[str, str]]) -> Image.Image:
    """The items (shape, colour) on a 4 × 4 grid of 28-pixel cells, one per cell, at random cells."""
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for (shape, colour), cell in zip(items, rng.sample(range(16), len(items)), strict=False):
        left, top = (cell % 4) * 28 + 4, (cell // 4) * 28 + 4
        _draw(draw, shape, (left, top, left + 19, top + 19), COLOURS[colour])
    return image


def _count(rng: random.Random) -> dict:
    n = rng.randint(1, 8)
    items = [(rng.choice(SHAPES), rng.choice(list(COLOURS))) for _ in range(n)]
    return {"image": _scatter(rng, items), "question": "How many shapes are in the image?", "answer": n}


def _compare(rng: random.Random) -> dict:
    more, fewer = rng.sample(list(COLOURS), 2)
    n_fewer = rng.randint(0, 4)
    n_more = n_fewer + rng.randint(1, 5)
    items = [(rng.choice(SHAPES), more) for _ in range(n_more)] + [(rng.choice(SHAPES), fewer) for _ in range(n_fewer)]
    rng.shuffle(items)
    return {"image": _scatter(rng, items), "question": f"How many more {more} shapes than {fewer} shapes are there?",
            "answer": n_more - n_fewer}


def _length(rng: random.Random) -> dict:
    """A bar over whole cells of a grid of 14-pixel cells; the question asks its length in cells."""
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for i in range(0, SIZE + 1, 14):
        draw.line([(i, 0), (i, SIZE)], fill=(200, 200, 200))
        draw.line([(0, i), (SIZE, i)], fill=(200, 200, 200))
    cells = rng.randint(1, 7)
    row, start = rng.randint(0, 7), rng.randint(0, 8 - cells)
    colour = COLOURS[rng.choice(list(COLOURS))]
    draw.rectangle((start * 14 + 2, row * 14 + 3, (start + cells) * 14 - 2, row * 14 + 11), fill=colour)
    return {"image": image, "question": "How many grid cells long is the bar?", "answer": cells}


KINDS = {"count": _count, "compare": _compare, "length": _length}


def generate_shape_problems(kind: str = "mixed", num_samples: int = 1000, seed: int = 0) -> list[dict]:
    """`num_samples` rows of `kind` (count, compare, length, or mixed), the same for the same seed."""
    makers = list(KINDS.values()) if kind == "mixed" else [KINDS.get(kind)]
    if makers == [None]:
        raise ValueError(f"unknown shape task {kind!r}; choose one of {', '.join(KINDS)} or mixed.")
    rng = random.Random(seed)
    rows = []
    for i in range(num_samples):
        maker = rng.choice(makers)
        made = maker(rng)
        answer = str(made["answer"])
        rows.append({"images": [_png(made["image"])], "problem": f"<image>{made['question']}", "answer": answer,
                     "solution": f"The answer is {answer}.", "kind": maker.__name__.removeprefix("_"), "id": i})
    return rows
