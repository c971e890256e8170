"""The scenes test bed's renderer, captions and split, and GenEvalReward's exact reader on rendered ground truth."""

import json

import numpy as np
import pytest
import torch

from jagg_lightning.models.conditions import ConditionedPrompt, read_conditioned_prompts
from jagg_lightning.rewards import GenEvalReward
from jagg_lightning.rewards.geneval_rules import TASKS
from jagg_lightning.rewards.geneval_scenes import SceneReader
from jagg_lightning.rewards.registry import build_reward
from jagg_lightning.testbed.scenes import (HELDOUT_METADATA, PALETTE, SHAPES, TRAIN_METADATA, Scene, place, render,
                                           scene_for, split_metadata)
from jagg_lightning.testbed.scenes import captions

GENEVAL_FIELDS = {"tag", "include", "exclude", "prompt"}


def random_scene(rng, side=64):
    wanted = [(SHAPES[rng.integers(len(SHAPES))], list(PALETTE)[rng.integers(len(PALETTE))])
              for _ in range(int(rng.integers(1, 5)))]
    return Scene(side, place(wanted, rng, side), int(rng.integers(96, 161)), int(rng.integers(0, 7)),
                 int(rng.integers(2**31)))


def as_batch(images):
    return torch.stack([torch.from_numpy(np.array(i)).permute(2, 0, 1).float() / 255 for i in images])


def test_the_reader_reads_rendered_scenes_back_exactly(rng_seed):
    """Shapes, colours and boxes of 1-4 objects, every one confident past GenEval's counting threshold (0.9)."""
    rng, reader = np.random.default_rng(rng_seed), SceneReader()
    for _ in range(60):
        scene = random_scene(rng)
        found = reader.read(np.asarray(render(scene)))
        read = sorted((shape, d.color, d.box) for shape, ds in found.items() for d in ds)
        truth = sorted((o.shape, o.color, tuple(float(round(v)) for v in o.box())) for o in scene.objects)
        assert read == truth, (scene, read)
        assert all(d.score > 0.9 and d.mask.sum() > 0 for ds in found.values() for d in ds)


def test_the_reader_allows_a_decoders_softening(rng_seed):
    """A VAE returns a render about a pixel softer (rounded tips); the prototypes allow for it: after a 0.8 px
    Gaussian blur most held-out ground truth still scores correct (1.00 on 720 scenes with today's object sizes;
    0.78 once with the exact shapes' prototypes), while the sharp renders all do (the test above)."""
    import torchvision.transforms.functional as TF

    rng = np.random.default_rng(rng_seed)
    prompts = read_conditioned_prompts(HELDOUT_METADATA, "data.val_prompts_file")
    chosen = [prompts[i] for i in rng.integers(0, len(prompts), 360)]
    images = as_batch([render(scene_for(p.metadata, rng)) for p in chosen])
    softened = (TF.gaussian_blur(images, 5, 0.8) * 255).round() / 255
    assert GenEvalReward().correct(softened, chosen).float().mean() >= 0.85  # +-0.016 (one std) at 360


def canvas_and_grid(rng, side=64):
    """A grey, lightly textured background [side, side, 3] float32 and the pixel centres' (x, y) grids."""
    image = np.full((side, side, 3), rng.integers(96, 161), np.float32) + rng.integers(-6, 7, (side, side, 1))
    ys, xs = np.mgrid[:side, :side] + 0.5
    return image, xs, ys


def soft_square(rng, xs, ys):
    """A square's mask with corners rounded by 10-25 % of its side, turned by up to 6 degrees: how the model draws
    squares (fill 0.83-0.98 where the judge sees a square, docs/testbed.md)."""
    side, turn = rng.uniform(20, 28), np.deg2rad(rng.uniform(-6, 6))
    radius, (cx, cy) = rng.uniform(0.1, 0.25) * side, rng.uniform(side / 2 + 6, 58 - side / 2, 2)
    u = (xs - cx) * np.cos(turn) + (ys - cy) * np.sin(turn)
    v = (ys - cy) * np.cos(turn) - (xs - cx) * np.sin(turn)
    du, dv = (np.maximum(np.abs(w) - (side / 2 - radius), 0) for w in (u, v))
    return du ** 2 + dv ** 2 < radius ** 2


def irregular_circle(rng, xs, ys):
    """A disc stretched by up to 8 % and its radius waved by 4-8 % (2, 3 or 5 lobes): the model's circles."""
    radius, (cx, cy) = rng.uniform(10, 14), rng.uniform(20, 44, 2)
    stretch, lobes, depth = rng.uniform(0.92, 1.08), rng.choice([2, 3, 5]), rng.uniform(0.04, 0.08)
    angle = np.arctan2(ys - cy, xs - cx)
    outline = radius * (1 + depth * np.sin(lobes * angle + rng.uniform(0, 2 * np.pi)))
    return np.hypot((xs - cx) * stretch, (ys - cy) / stretch) < outline


def test_soft_squares_and_irregular_circles_count(rng_seed):
    """What the shipped model draws and the judge calls right: a square with soft corners, a slightly irregular
    circle. Each reads as its shape above GenEval's counting threshold (0.9); the reader before the fourfold moment
    read 38-53 % of such squares so (the rest as circles) and 90 % of such circles."""
    rng, reader = np.random.default_rng(rng_seed), SceneReader()
    for shape, mask_of in (("square", soft_square), ("circle", irregular_circle)):
        read = []
        for _ in range(40):
            image, xs, ys = canvas_and_grid(rng)
            image[mask_of(rng, xs, ys)] = PALETTE[list(PALETTE)[rng.integers(len(PALETTE))]]
            found = reader.read(image.round().astype(np.uint8))
            read.append([(name, d.score) for name, ds in found.items() for d in ds])
        right = [len(r) == 1 and r[0][0] == shape and r[0][1] > 0.9 for r in read]
        assert np.mean(right) >= 0.95, (shape, [r for r, ok in zip(read, right) if not ok])


def test_a_textured_blob_is_no_confident_shape(rng_seed):
    """GRPO once hacked the reader with large textured blobs read as circles. A disc of a palette colour reads as a
    circle above 0.9; the same disc under per-pixel colour noise (std 45 levels a channel) or speckled (30 % of its
    pixels another palette colour) gives no object of a quarter of its area above GenEval's 0.3 (before the colour
    and hole terms: 0.77-1.00 and 0.59-1.00). White is left out of the noise case: its noise is clipped at 255,
    which halves the distance from the palette colour (white noisy discs still read 0.24-0.45)."""
    rng, reader = np.random.default_rng(rng_seed), SceneReader()
    names = list(PALETTE)
    for _ in range(16):
        image, xs, ys = canvas_and_grid(rng)
        radius, (cx, cy) = rng.uniform(10, 14), rng.uniform(17, 47, 2)
        inside = (xs - cx) ** 2 + (ys - cy) ** 2 < radius ** 2
        name = names[rng.integers(len(names) - 1)]  # not white (the last)
        colour = np.array(PALETTE[name], np.float32)
        others = np.array([PALETTE[n] for n in names if n != name], np.float32)
        flat, noisy, speckled = image.copy(), image.copy(), image.copy()
        flat[inside] = colour
        noisy[inside] = colour + rng.normal(0, 45, (inside.sum(), 3))
        speckled[inside] = np.where(rng.random((inside.sum(), 1)) < 0.3,
                                    others[rng.integers(0, len(others), inside.sum())], colour)
        found = reader.read(flat.round().astype(np.uint8))
        assert [(s, d.color) for s, ds in found.items() for d in ds] == [("circle", name)]
        assert found["circle"][0].score > 0.9
        for textured in (noisy, speckled):
            found = reader.read(textured.clip(0, 255).round().astype(np.uint8))
            scores = [d.score for ds in found.values() for d in ds if d.mask.sum() > inside.sum() / 4]
            assert max(scores, default=0.0) < 0.3, scores


def test_rendering_is_deterministic_from_the_seed(rng_seed):
    row = json.loads(TRAIN_METADATA.read_text().splitlines()[-1])
    first = np.asarray(render(scene_for(row, np.random.default_rng(rng_seed))))
    again = np.asarray(render(scene_for(row, np.random.default_rng(rng_seed))))
    other = np.asarray(render(scene_for(row, np.random.default_rng(rng_seed + 1))))
    assert first.shape == (64, 64, 3) and np.array_equal(first, again) and not np.array_equal(first, other)


def test_a_scene_for_a_row_satisfies_it_and_not_another_rows(rng_seed):
    """Rendered for its own row, every row of both files scores 1 under all three scores; judged against a row of
    another colour, count or relation, it is wrong."""
    rng = np.random.default_rng(rng_seed)
    prompts = read_conditioned_prompts(TRAIN_METADATA, "data.prompts_file") + \
        read_conditioned_prompts(HELDOUT_METADATA, "data.val_prompts_file")
    chosen = [prompts[i] for i in rng.choice(len(prompts), 48, replace=False)]
    images = as_batch([render(scene_for(p.metadata, rng)) for p in chosen])
    for score in ("flow_grpo", "strict", "geneval"):
        torch.testing.assert_close(GenEvalReward(score=score)(images, chosen), torch.ones(len(chosen)))
    reward = build_reward("geneval")
    circle = captions.colors("red", "circle")
    image = as_batch([render(scene_for(circle, rng))])
    for wrong in (captions.colors("blue", "circle"), captions.colors("red", "square"), captions.counting("circle", 2)):
        prompt = ConditionedPrompt(wrong["prompt"], (), "", wrong)
        assert not reward.correct(image, [prompt]).item() and reward(image, [prompt]).item() < 1
    left = captions.position("circle", "left of", "square")
    image = as_batch([render(scene_for(left, rng))])
    right = captions.position("circle", "right of", "square")
    assert reward.correct(image, [ConditionedPrompt(left["prompt"], (), "", left)]).item()
    assert not reward.correct(image, [ConditionedPrompt(right["prompt"], (), "", right)]).item()


def test_phrasing_is_genevals_word_for_word():
    """Rows of GenEval's own prompts/evaluation_metadata.jsonl, rebuilt by the caption functions."""
    genevals = [
        '{"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"}',
        '{"tag": "two_object", "include": [{"class": "toaster", "count": 1}, {"class": "oven", "count": 1}], '
        '"prompt": "a photo of a toaster and an oven"}',
        '{"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}], '
        '"prompt": "a photo of two clocks"}',
        '{"tag": "colors", "include": [{"class": "car", "count": 1, "color": "pink"}], '
        '"prompt": "a photo of a pink car"}',
        '{"tag": "position", "include": [{"class": "teddy bear", "count": 1}, {"class": "dog", "count": 1, '
        '"position": ["right of", 0]}], "prompt": "a photo of a dog right of a teddy bear"}',
        '{"tag": "color_attr", "include": [{"class": "bus", "count": 1, "color": "green"}, {"class": "microwave", '
        '"count": 1, "color": "purple"}], "prompt": "a photo of a green bus and a purple microwave"}',
    ]
    built = [captions.single_object("bench"), captions.two_object("toaster", "oven"), captions.counting("clock", 2),
             captions.colors("pink", "car"), captions.position("dog", "right of", "teddy bear"),
             captions.color_attr("green", "bus", "purple", "microwave")]
    assert [json.dumps(b) for b in built] == genevals


def test_the_split_holds_compositions_out_and_keeps_every_word():
    train, heldout = split_metadata()
    assert TRAIN_METADATA.read_text() == captions.metadata_lines(train)      # the shipped files are the recipe's
    assert HELDOUT_METADATA.read_text() == captions.metadata_lines(heldout)
    assert {r["tag"] for r in heldout} == {r["tag"] for r in train} == set(TASKS)
    assert all(set(r) <= GENEVAL_FIELDS for r in train + heldout)
    assert not any(captions.is_heldout(r) for r in train)
    assert all(captions.is_heldout(r) for r in heldout if r["tag"] != "single_object")
    pairs = {(q.get("color"), q["class"]) for r in train for q in r["include"]}
    assert not pairs & set(captions.HELDOUT_PAIRS)
    assert {(r["include"][0]["class"], r["include"][0]["count"]) for r in heldout if r["tag"] == "counting"} == \
        set(captions.HELDOUT_COUNTS)
    train_words = {w for r in train for w in r["prompt"].split()}
    assert {w for r in heldout for w in r["prompt"].split()} <= train_words


@pytest.mark.parametrize("side", [32, 48])
def test_smaller_scenes_read_back_shapes_and_colours(rng_seed, side):
    """At 32 and 48 px the reader still names every object (its confidence may fall under 0.9 at 32 px)."""
    rng, reader = np.random.default_rng(rng_seed), SceneReader()
    for _ in range(20):
        scene = random_scene(rng, side)
        found = reader.read(np.asarray(render(scene)))
        assert sorted((s, d.color) for s, ds in found.items() for d in ds) == \
            sorted((o.shape, o.color) for o in scene.objects)


@pytest.mark.parametrize("object_size", [(0.18, 0.3), (0.35, 0.5)])
def test_object_size_sets_the_sides_and_the_scene_still_reads_right(object_size, rng_seed):
    """``scene_for``'s ``object_size`` (the one-prompt test's larger objects, docs/testbed.md): the sides are drawn
    in the range, and the rows still render right by GenEval's rules."""
    rows = [json.loads(line) for line in TRAIN_METADATA.read_text().splitlines()]
    rng = np.random.default_rng(rng_seed)
    low, high = object_size[0] * 64 - 0.5, object_size[1] * 64 + 0.5
    singles = [r for r in rows if r["tag"] == "single_object"]
    scenes = [scene_for(singles[i % len(singles)], rng, object_size=object_size) for i in range(12)]
    assert all(low <= o.size <= high for s in scenes for o in s.objects)
    assert len({o.size for s in scenes for o in s.objects}) > 1  # drawn, not fixed
    chosen = [rows[i] for i in rng.choice(len(rows), 12, replace=False)]
    images = as_batch([render(scene_for(r, rng, object_size=object_size)) for r in chosen])
    prompts = [ConditionedPrompt(r["prompt"], (), "", r) for r in chosen]
    assert GenEvalReward(score="geneval").correct(images, prompts).all()
