"""Scene specs and their Pillow rendering: flat shapes on a grey, lightly textured background, from a seed.

A :class:`Scene` is plain data (its objects' shape, colour, centre and size in pixels, the background grey and
its texture amplitude); :func:`render` draws it without anti-aliasing, so every object pixel has its palette colour
exactly (what :class:`~jagg_lightning.rewards.geneval_scenes.SceneReader` reads back). :func:`scene_for` builds a
scene that satisfies a GenEval metadata row (its include clauses: classes, counts, colours, relations; nothing
else in the picture), drawing positions, jitter and sizes from a ``numpy`` generator: the same seed, the same
scene.

Placement: object sides are drawn in [``min_fraction``, ``max_fraction``] of the image side; centres uniformly,
each box at least ``margin`` pixels off the border and ``gap`` pixels from every other box (so objects of one
colour never touch and the reader's components are the objects). A relation is placed by rejection against
GenEval's own :func:`~jagg_lightning.rewards.geneval_rules.relative_position` with a doubled margin (0.2), so
it holds with room to spare.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

from jagg_lightning.rewards.geneval_rules import Detection, relative_position
from jagg_lightning.rewards.geneval_scenes import PALETTE, SHAPES

PLACEMENT_TRIES = 400


@dataclass
class SceneObject:
    """One object: ``shape`` (of ``SHAPES``), ``color`` (of ``PALETTE``), centre (``x``, ``y``), ``size`` (side of
    its square box), all in pixels."""

    shape: str
    color: str
    x: float
    y: float
    size: float

    def box(self) -> tuple[float, float, float, float]:
        half = self.size / 2
        return (self.x - half, self.y - half, self.x + half, self.y + half)


@dataclass
class Scene:
    """Objects on a background: ``side`` pixels square, grey level ``background``, per-pixel noise of at most
    ``texture`` grey levels (0 = plain), drawn from ``texture_seed``."""

    side: int
    objects: list[SceneObject] = field(default_factory=list)
    background: int = 128
    texture: int = 0
    texture_seed: int = 0


def render(scene: Scene) -> Image.Image:
    """The scene as an RGB image (no anti-aliasing: object pixels are exact palette colours)."""
    rng = np.random.default_rng(scene.texture_seed)
    noise = rng.integers(-scene.texture, scene.texture + 1, size=(scene.side, scene.side, 1)) if scene.texture else 0
    base = np.clip(np.full((scene.side, scene.side, 3), scene.background) + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(base, "RGB")
    draw = ImageDraw.Draw(image)
    for obj in scene.objects:
        x0, y0, x1, y1 = (round(v) for v in obj.box())
        x1, y1 = x1 - 1, y1 - 1  # Pillow's boxes include their last pixel
        fill = PALETTE[obj.color]
        if obj.shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif obj.shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        elif obj.shape == "triangle":
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
        elif obj.shape == "diamond":
            cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
            draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill)
        else:
            raise ValueError(f"scene object shape must be one of {SHAPES}, got {obj.shape!r}")
    return image


def _apart(box, others, gap: float) -> bool:
    return all(box[2] + gap <= o[0] or o[2] + gap <= box[0] or box[3] + gap <= o[1] or o[3] + gap <= box[1]
               for o in others)


def _holds(objects: list[SceneObject], relations: list[tuple[int, str, int]]) -> bool:
    def as_detection(obj):
        return Detection(obj.box(), 1.0)
    return all(rel in relative_position(as_detection(objects[a]), as_detection(objects[b]), 0.2)
               for a, rel, b in relations)


# the test bed's objects' sides, fractions of the image (at 0.18-0.3 the model drew blobs: docs/testbed.md)
OBJECT_SIZE = (0.35, 0.5)
# where objects go: "free" (anywhere, apart) or "grid" (one object per cell of a GRID x GRID grid, jittered in it)
LAYOUTS = ("free", "grid")
LAYOUT = "grid"  # the scenes model's (the recipe's default); scene_for's default stays "free"
OBJECT_SIZES = {"free": OBJECT_SIZE, "grid": (0.34, 0.44)}  # a grid cell holds sides up to 28 px at 64 px
GRID = 2
GRID_INSET = 2  # pixels between a box and its cell's border: grid boxes are >= 4 px apart, >= 2 px off the image's


def place(wanted: list[tuple[str, str]], rng: np.random.Generator, side: int = 64,
          relations: list[tuple[int, str, int]] = (), min_fraction: float = OBJECT_SIZE[0],
          max_fraction: float = OBJECT_SIZE[1],
          margin: int = 2, gap: int = 3) -> list[SceneObject]:
    """Objects of the given (shape, colour) with sizes and positions drawn from ``rng``: apart by ``gap`` pixels,
    ``margin`` off the border, and each relation (object a, "left of" | "right of" | "above" | "below", object b)
    holding (see the module docstring). Sizes shrink by a tenth after every ``PLACEMENT_TRIES`` failed tries."""
    shrink = 1.0
    for _ in range(8):
        for _ in range(PLACEMENT_TRIES):
            objects = []
            for shape, color in wanted:
                size = float(round(side * shrink * rng.uniform(min_fraction, max_fraction)))
                size = max(size, 9.0)
                low, high = margin + size / 2, side - margin - size / 2
                for _ in range(50):
                    x, y = round(rng.uniform(low, high)), round(rng.uniform(low, high))
                    obj = SceneObject(shape, color, float(x), float(y), size)
                    if _apart(obj.box(), [o.box() for o in objects], gap):
                        objects.append(obj)
                        break
                else:
                    break
            if len(objects) == len(wanted) and _holds(objects, list(relations)):
                return objects
        shrink *= 0.9
    raise RuntimeError(f"could not place {wanted} with relations {list(relations)} in {side} px")


def place_grid(wanted: list[tuple[str, str]], rng: np.random.Generator, side: int = 64,
               relations: list[tuple[int, str, int]] = (), min_fraction: float = OBJECT_SIZE[0],
               max_fraction: float = OBJECT_SIZE[1]) -> list[SceneObject]:
    """Objects of the given (shape, colour), one per cell of a ``GRID`` x ``GRID`` grid (cells drawn without
    replacement), each side drawn in [``min_fraction``, ``max_fraction``] of the image and capped to its cell less
    ``GRID_INSET`` on every side, its centre jittered uniformly inside the cell; each relation (as :func:`place`'s)
    holding, by rejection over the cells and jitter. Fewer layouts than :func:`place`'s continuum, so a small model
    commits to one from noise (docs/testbed.md, "The layout")."""
    cell = side / GRID
    if len(wanted) > GRID * GRID:
        raise ValueError(f"place_grid: {len(wanted)} objects do not fit a {GRID} x {GRID} grid")
    largest = cell - 2 * GRID_INSET
    for _ in range(PLACEMENT_TRIES):
        cells = rng.permutation(GRID * GRID)[:len(wanted)]
        objects = []
        for (shape, color), c in zip(wanted, cells):
            size = float(min(largest, round(side * rng.uniform(min_fraction, max_fraction))))
            row, col = divmod(int(c), GRID)
            room = (largest - size) / 2  # how far the centre may move from the cell's centre
            x = round(col * cell + cell / 2 + rng.uniform(-room, room))
            y = round(row * cell + cell / 2 + rng.uniform(-room, room))
            objects.append(SceneObject(shape, color, float(x), float(y), size))
        if _holds(objects, list(relations)):
            return objects
    raise RuntimeError(f"could not place {wanted} with relations {list(relations)} on a {GRID} x {GRID} grid")


def scene_for(metadata: dict, rng: np.random.Generator, side: int = 64, texture: int = 6,
              object_size: tuple[float, float] = OBJECT_SIZE, layout: str = "free") -> Scene:
    """A scene that satisfies a GenEval metadata row exactly: each include clause's ``count`` objects of its class,
    in its colour (else one drawn from the palette), sides drawn in ``object_size`` (fractions of ``side``; smaller
    where they do not fit), in its relation to the first object of the target clause; the background grey drawn in
    [96, 160], textured with probability 1/2."""
    wanted, first_of, relations = [], [], []
    for req in metadata["include"]:
        first_of.append(len(wanted))
        for _ in range(req["count"]):
            color = req.get("color") or list(PALETTE)[int(rng.integers(len(PALETTE)))]
            wanted.append((req["class"], color))
    for i, req in enumerate(metadata["include"]):
        if "position" in req:
            rel, target = req["position"]
            target_count = metadata["include"][target]["count"]
            relations += [(first_of[i] + k, rel, first_of[target] + j)
                          for k in range(req["count"]) for j in range(target_count)]
    if layout not in LAYOUTS:
        raise ValueError(f"scene_for: layout must be one of {LAYOUTS}, got {layout!r}")
    placer = place_grid if layout == "grid" else place
    objects = placer(wanted, rng, side, relations, min_fraction=object_size[0], max_fraction=object_size[1])
    background = int(rng.integers(96, 161))
    return Scene(side, objects, background, texture if rng.random() < 0.5 else 0, int(rng.integers(2**31)))
