"""Synthetic captioning scenes: one to three coloured shapes on a plain background, with an exact caption.

The caption is a function of the image (the spec is in data/README.md), so a captioner can be scored by
exact match. Every scene is drawn from its own seed: scene i of a split is reproducible alone.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

IMAGE_SIZE = 64  # pixels, square
SUPERSAMPLE = 4  # drawn at 4x and downsampled, for smooth edges

SHAPES = ("circle", "square", "triangle", "star", "diamond")
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (40, 80, 235),
    "yellow": (240, 215, 20),
    "purple": (150, 50, 200),
    "orange": (255, 135, 0),
}
BACKGROUNDS = {"black": (0, 0, 0), "dark gray": (64, 64, 64), "light gray": (200, 200, 200), "white": (255, 255, 255)}
SIZES = {"small": (4.0, 6.0), "large": (9.0, 12.0)}  # circumradius range in pixels
THREE_SHAPE_SCALE = 0.8  # both sizes shrink in three-shape scenes, so three large shapes fit 21 px cells


@dataclass(frozen=True)
class Shape:
    kind: str  # one of SHAPES
    colour: str  # a key of COLOURS
    size: str  # "small" or "large"
    x: float  # centre, pixels from the left
    y: float  # centre, pixels from the top
    radius: float  # circumradius in pixels

    def phrase(self) -> str:
        return f"a {self.size} {self.colour} {self.kind}"


@dataclass(frozen=True)
class Scene:
    shapes: tuple[Shape, ...]  # in caption order: left to right, or top to bottom
    layout: str  # "single", "row" or "column"
    background: str  # a key of BACKGROUNDS

    @property
    def caption(self) -> str:
        phrases = [s.phrase() for s in self.shapes]
        if self.layout == "single":
            return phrases[0]
        if len(phrases) == 2:
            relation = "to the left of" if self.layout == "row" else "above"
            return f"{phrases[0]} {relation} {phrases[1]}"
        direction = "from left to right" if self.layout == "row" else "from top to bottom"
        return f"{phrases[0]}, {phrases[1]} and {phrases[2]} {direction}"


def random_scene(rng: random.Random, small_scale: float = THREE_SHAPE_SCALE) -> Scene:
    """small_scale: the factor of small shapes in three-shape scenes, placed as if unscaled; 1.0 draws them as the
    generator did before they were scaled (4-6 px), for measuring that reading of the spec. The draws from rng, and
    so the caption and every shape's centre, do not depend on it."""
    n = rng.choice((1, 2, 3))
    layout = "single" if n == 1 else rng.choice(("row", "column"))
    background = rng.choice(list(BACKGROUNDS))
    cell = IMAGE_SIZE / n
    across = rng.uniform(20, IMAGE_SIZE - 20)  # shared cross-axis position, jittered per shape below
    shapes = []
    for i in range(n):
        size = rng.choice(list(SIZES))
        radius = rng.uniform(*SIZES[size]) * (THREE_SHAPE_SCALE if n == 3 and size == "large" else 1.0)
        slack = max(0.0, cell / 2 - radius - 0.5)  # jitter along the layout that keeps the shape in its cell
        along = cell * (i + 0.5) + rng.uniform(-slack, slack)
        off = across + rng.uniform(-4, 4)
        if layout == "single":
            along, off = rng.uniform(16, IMAGE_SIZE - 16), rng.uniform(16, IMAGE_SIZE - 16)
        margin = radius + 1
        along = min(max(along, margin), IMAGE_SIZE - margin)
        off = min(max(off, margin), IMAGE_SIZE - margin)
        x, y = (off, along) if layout == "column" else (along, off)
        if n == 3 and size == "small":  # shrunk about the centre it had unscaled: gaps between shapes only grow
            radius *= small_scale
        shapes.append(Shape(rng.choice(SHAPES), rng.choice(list(COLOURS)), size, x, y, radius))
    return Scene(tuple(shapes), layout, background)


def scene_for(seed: int, index: int, small_scale: float = THREE_SHAPE_SCALE) -> Scene:
    return random_scene(random.Random(f"{seed}:{index}"), small_scale)


def _polygon(kind: str, x: float, y: float, r: float) -> list[tuple[float, float]]:
    if kind == "square":
        h = r / math.sqrt(2)
        return [(x - h, y - h), (x + h, y - h), (x + h, y + h), (x - h, y + h)]
    if kind == "diamond":
        return [(x, y - r), (x + r * 0.8, y), (x, y + r), (x - r * 0.8, y)]
    if kind == "triangle":
        return [(x + r * math.cos(a), y - r * math.sin(a)) for a in (math.pi / 2, math.pi * 7 / 6, math.pi * 11 / 6)]
    if kind == "star":
        points = []
        for k in range(10):
            a = math.pi / 2 + k * math.pi / 5
            rr = r if k % 2 == 0 else r * 0.45
            points.append((x + rr * math.cos(a), y - rr * math.sin(a)))
        return points
    raise ValueError(f"unknown shape {kind!r}")


def draw(scene: Scene) -> Image.Image:
    """The scene as an RGB image of IMAGE_SIZE x IMAGE_SIZE pixels."""
    s = SUPERSAMPLE
    image = Image.new("RGB", (IMAGE_SIZE * s, IMAGE_SIZE * s), BACKGROUNDS[scene.background])
    pen = ImageDraw.Draw(image)
    for shape in scene.shapes:
        fill = COLOURS[shape.colour]
        x, y, r = shape.x * s, shape.y * s, shape.radius * s
        if shape.kind == "circle":
            pen.ellipse([x - r, y - r, x + r, y + r], fill=fill)
        else:
            pen.polygon(_polygon(shape.kind, x, y, r), fill=fill)
    return image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.LANCZOS)


def write_imagefolder(directory: str, count: int, seed: int, progress: bool = True,
                      small_scales: tuple[float, float] | None = None) -> None:
    """A Hugging Face imagefolder: PNG files + metadata.jsonl with file_name and text (the caption).

    small_scales (low, high): each scene's small_scale drawn uniformly from it (from its own generator, so the
    captions and centres are those of the spec's drawing); None: the spec's THREE_SHAPE_SCALE.
    Written incrementally and resumable: an interrupted run picks up after the last complete line.
    """
    from tqdm import tqdm

    from ..jobs import finished_inputs

    os.makedirs(directory, exist_ok=True)
    metadata = os.path.join(directory, "metadata.jsonl")
    done = len(finished_inputs(metadata, key="file_name"))  # also drops a line cut by a kill
    with open(metadata, "a") as f:
        for index in tqdm(range(done, count), desc=os.path.basename(directory), disable=not progress, initial=done,
                          total=count):
            small_scale = THREE_SHAPE_SCALE
            if small_scales is not None:
                small_scale = random.Random(f"{seed}:{index}:small_scale").uniform(*small_scales)
            scene = scene_for(seed, index, small_scale)
            name = f"{index:06d}.png"
            draw(scene).save(os.path.join(directory, name))
            f.write(json.dumps({"file_name": name, "text": scene.caption}) + "\n")
            f.flush()


def vocabulary() -> list[str]:
    """Every word (and the comma) a caption can contain."""
    words = {"a", "to", "the", "left", "of", "above", "and", "from", "right", "top", "bottom", ","}
    words.update(SHAPES)
    words.update(SIZES)
    words.update(COLOURS)
    return sorted(words)
