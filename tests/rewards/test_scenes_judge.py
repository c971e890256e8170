"""The scenes test bed's independent judge: a learned reader under GenEval's same rules, never the reward."""

import json

import numpy as np
import pytest
import torch

from jagg_lightning.rewards.geneval import read_and_judge
from jagg_lightning.rewards.geneval_scenes import SceneReader
from jagg_lightning.testbed.scenes import HELDOUT_METADATA, TRAIN_METADATA, render, scene_for
from jagg_lightning.testbed.scenes.judge import (SCENES_JUDGE_PATH, SIDE, THRESHOLDS, SceneJudge, SceneJudgeReader,
                                                 decode, degrade, fit, load_scene_judge, random_scene, targets)
from jagg_lightning.models.conditions import ConditionedPrompt


def rows_and_images(rng, count: int, degraded: bool, generator=None):
    rows = [json.loads(line) for path in (TRAIN_METADATA, HELDOUT_METADATA) for line in path.read_text().splitlines()]
    chosen = [rows[i] for i in rng.choice(len(rows), count, replace=False)]
    images = torch.from_numpy(np.stack([np.asarray(render(scene_for(r, rng))) for r in chosen]))
    images = images.permute(0, 3, 1, 2).float() / 255
    if degraded:
        images = degrade(images, generator)
    prompts = [ConditionedPrompt(r["prompt"], origin=f"row {i}", metadata=r) for i, r in enumerate(chosen)]
    return prompts, images


def test_decoding_a_perfect_heat_map_gives_back_every_object(rng_seed):
    """The CenterNet targets of random scenes, turned into logits, decode to the scenes' objects: shape, colour and
    a box whose centre is the object's to a tenth of a pixel (at 64 px and at 128 px)."""
    rng = np.random.default_rng(rng_seed)
    scenes = [random_scene(rng) for _ in range(8)]
    heat, colour, offsets, sides, _ = targets(scenes)
    logits = torch.where(heat == 1, 8.0, -8.0)
    colour_logits = torch.nn.functional.one_hot(colour.clamp_min(0), 6).permute(0, 3, 1, 2).float() * 8
    for scale in (1, 2):
        found = decode(logits, colour_logits, offsets, sides, SIDE * scale, SIDE * scale)
        for scene, objects in zip(scenes, found):
            read = sorted((s, c, round((b[0] + b[2]) / 2 / scale, 1), round((b[1] + b[3]) / 2 / scale, 1),
                           round((b[2] - b[0]) / scale, 1)) for s, c, _, b in objects)
            truth = sorted((o.shape, o.color, round(o.x, 1), round(o.y, 1), round(o.size, 1)) for o in scene.objects)
            assert read == truth and all(p > 0.99 for *_, p, _ in objects), (read, truth)


@pytest.mark.parametrize("degraded", [False, True])
def test_the_shipped_judge_reads_rendered_scenes(rng_seed, degraded):
    """Fresh scenes rendered to satisfy train and held-out rows (blurred, noised and colour-shifted as generated
    images are, or clean): the judge calls >= 97 % of them right under GenEval's rules, and against a mismatched
    row it agrees with the exact reader on >= 95 % (so it is a reader, not a yes-sayer)."""
    rng, generator = np.random.default_rng(rng_seed), torch.Generator().manual_seed(rng_seed)
    prompts, images = rows_and_images(rng, 120, degraded, generator)
    judge = SceneJudgeReader(load_scene_judge())
    right = read_and_judge(judge, images, prompts, THRESHOLDS)
    assert np.mean([j.correct for j in right]) >= 0.97, [j.reason for j in right if not j.correct][:5]
    mismatched = prompts[1:] + prompts[:1]
    by_judge = read_and_judge(judge, images, mismatched, THRESHOLDS)
    by_reader = read_and_judge(SceneReader(), images, mismatched)
    assert np.mean([a.correct == b.correct for a, b in zip(by_judge, by_reader)]) >= 0.95
    assert np.mean([j.correct for j in by_reader]) < 0.5  # the mismatch is mostly wrong, so agreement means reading


def test_the_fit_is_deterministic_and_the_file_round_trips(tmp_path):
    """Two fits with one seed give the same weights; saved and loaded, the judge reads the same."""
    from safetensors.torch import save_file

    first, second = fit(3, 4, 3e-3, 4, seed=7, log=lambda _: None), fit(3, 4, 3e-3, 4, seed=7, log=lambda _: None)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    path = tmp_path / "judge.safetensors"
    save_file(first.state_dict(), str(path), metadata={"width": "4"})
    loaded = load_scene_judge(path)
    images = torch.rand(2, 3, SIDE, SIDE)
    assert all(torch.equal(a, b) for a, b in zip(first(images), loaded(images)))
    assert not any(p.requires_grad for p in loaded.parameters()) and not loaded.training
    with pytest.raises(FileNotFoundError, match="judge_path"):
        load_scene_judge(tmp_path / "missing.safetensors")


def test_the_shipped_judge_records_its_fit():
    from safetensors import safe_open

    with safe_open(str(SCENES_JUDGE_PATH), "pt") as f:
        metadata = f.metadata()
    assert json.loads(metadata["clean"])["overall"] >= 0.98 and json.loads(metadata["degraded"])["overall"] >= 0.95
    assert isinstance(load_scene_judge(), SceneJudge)
