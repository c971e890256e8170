"""An independent judge for the scenes test bed: a learned reader that GRPO never sees.

``GenEvalReward`` with its ``scenes`` reader is what GRPO maximises: colour segmentation, connected components and
a shape from three geometric features. A rising held-out score from that reader could be reward hacking -- images
drifting toward whatever passes its nearest-colour rule and its fill / aspect / centroid prototypes. The judge reads
the same images another way and applies GenEval's same rules to what it reads (so it answers the same question):

* a small convolutional detector in the style of CenterNet, never shown a generated image: per shape a heat map of
  object centres on a 4 px grid, and at each cell the colour (six-way), the centre's sub-cell offset and the
  object's side;
* trained on random rendered scenes (1-4 objects of any shape and colour, every composition, held-out ones
  included: the judge is a reader, not the model) with blur, pixel noise, colour jitter and a contrast change, so
  it reads soft generated images, where the exact reader's pixel rule is strict;
* a peak (the 3 x 3 local maximum of a shape's heat map) is a detection: its class the shape, its colour the most
  likely at that cell, its confidence the peak's sigmoid, its box centre +- side / 2. GenEval's thresholds are
  calibrated to Mask2Former's scores; a heat-map peak is another scale (a clean object peaks at 0.7-0.98 here), so
  the judge keeps GenEval's 0.3 and counts objects above ``COUNTING_THRESHOLD`` = 0.5, a peak above half, where
  GenEval counts above 0.9 (:data:`THRESHOLDS`).

    heat[b, s, i, j] = P(an object of shape s has its centre in cell (i, j)),  colour[b, :, i, j] = its colour's logits

``python -m jagg_lightning.testbed.scenes.judge`` fits it (deterministic, a few minutes of one core) and writes
``scenes_judge.safetensors`` beside the digits judge (the weights, and the fit's settings and its accuracy on
rendered scenes in the metadata). :class:`SceneJudgeReader` is a GenEval reader like the others: the
``GenEvalAccuracy`` callback logs its reading of the held-out samples as ``val/judge_geneval/<task>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jagg_lightning.rewards.geneval_rules import Detection, Thresholds
from jagg_lightning.rewards.geneval_scenes import PALETTE, SHAPES

SCENES_JUDGE_PATH = Path(__file__).resolve().parent.parent / "scenes_judge.safetensors"
SIDE = 64  # the judge reads every image resized to 64 px
STRIDE = 4  # heat-map cell, pixels
COLOURS = list(PALETTE)
MIN_PEAK = 0.05  # peaks below this are not reported (the rules' thresholds select later)
COUNTING_THRESHOLD = 0.5  # the judge's counting threshold (GenEval's 0.9 is Mask2Former's scale; see above)
THRESHOLDS = Thresholds(counting_threshold=COUNTING_THRESHOLD)  # GenEval's others: 0.3, 16 objects, no NMS, 0.1


class SceneJudge(nn.Module):
    """[B, 3, H, W] in [0, 1] -> (shape heat logits [B, 4, 16, 16], colour logits [B, 6, 16, 16], offsets
    [B, 2, 16, 16] in cells, sides [B, 1, 16, 16] as a fraction of the image). ``width``: the first layer's
    channels."""

    def __init__(self, width: int = 16):
        super().__init__()
        w = width
        self.width = width
        self.body = nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(2 * w, 4 * w, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(4 * w, 4 * w, 3, padding=2, dilation=2), nn.ReLU(),
            nn.Conv2d(4 * w, 4 * w, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(4 * w, len(SHAPES) + len(COLOURS) + 3, 1)

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        x = images.float()
        if x.shape[-2:] != (SIDE, SIDE):
            x = F.interpolate(x, size=(SIDE, SIDE), mode="bilinear", align_corners=False, antialias=True)
        out = self.head(self.body(x * 2 - 1))
        return out.split([len(SHAPES), len(COLOURS), 2, 1], dim=1)

    @torch.no_grad()
    def peaks(self, images: Tensor) -> list[list[tuple[str, str, float, tuple[float, float, float, float]]]]:
        """Per image: (shape, colour, confidence, box in the image's own pixels) of every heat-map peak >= MIN_PEAK."""
        return decode(*self(images), height=images.shape[-2], width=images.shape[-1])


def decode(heat: Tensor, colours: Tensor, offsets: Tensor, sides: Tensor, height: int = SIDE, width: int = SIDE):
    """The judge's outputs -> per image, (shape, colour, confidence, box) of every 3 x 3 local maximum of a shape's
    heat-map sigmoid at or above ``MIN_PEAK``, with the cell's most likely colour; centres and sides scaled to a
    ``height`` x ``width`` image."""
    prob = heat.sigmoid()
    keep = (prob == F.max_pool2d(prob, 3, stride=1, padding=1)) & (prob >= MIN_PEAK)
    cell_x, cell_y = STRIDE * width / SIDE, STRIDE * height / SIDE
    found = []
    for b in range(len(heat)):
        objects = []
        for k, i, j in keep[b].nonzero().tolist():
            cx, cy = (j + offsets[b, 0, i, j].item()) * cell_x, (i + offsets[b, 1, i, j].item()) * cell_y
            half_x, half_y = sides[b, 0, i, j].item() * width / 2, sides[b, 0, i, j].item() * height / 2
            colour = COLOURS[int(colours[b, :, i, j].argmax())]
            objects.append((SHAPES[k], colour, float(prob[b, k, i, j]), (cx - half_x, cy - half_y, cx + half_x,
                                                                        cy + half_y)))
        found.append(objects)
    return found


class SceneJudgeReader:
    """The judge as a GenEval reader (``detect`` / ``colors``, the readers' common signature): each peak a
    :class:`~jagg_lightning.rewards.geneval_rules.Detection` with its colour set."""

    classnames = SHAPES

    def __init__(self, judge: SceneJudge):
        self.judge = judge

    def detect(self, images: list[np.ndarray], wanted=None) -> list[dict[str, list[Detection]]]:
        batch = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float().div(255)
        device = next(self.judge.parameters()).device
        out = []
        for objects in self.judge.peaks(batch.to(device)):
            found: dict[str, list[Detection]] = {}
            for shape, color, confidence, box in objects:
                found.setdefault(shape, []).append(Detection(box, confidence, None, color))
            out.append(found)
        return out

    def colors(self, image: np.ndarray, found: list[Detection], classname: str) -> list[str]:
        return [d.color for d in found]


def judge_geneval(judge_reader, reward, images, prompts: list) -> list:
    """GenEval's judgements of ``images`` read by the scenes judge under ``reward``'s rules, counting on the judge's
    own confidence scale (:data:`COUNTING_THRESHOLD`; GenEval's 0.9 is Mask2Former's)."""
    from jagg_lightning.rewards.geneval import read_and_judge

    thresholds = dataclasses.replace(reward.thresholds, counting_threshold=COUNTING_THRESHOLD)
    return read_and_judge(judge_reader, images, prompts, thresholds)


def load_scene_judge(path: str | Path = SCENES_JUDGE_PATH) -> SceneJudge:
    """The fitted judge (safetensors; its width from the file's metadata), frozen, in eval mode."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SceneJudge: judge_path {str(path)!r} does not exist (python -m "
                                "jagg_lightning.testbed.scenes.judge writes it)")
    with safe_open(str(path), "pt") as f:
        width = int((f.metadata() or {}).get("width", 16))
    judge = SceneJudge(width)
    judge.load_state_dict(load_file(str(path)))
    return judge.requires_grad_(False).eval()


# ------------------------------------------------------------------------------------------------ the fit

READ_SIZES = (0.15, 0.5)  # the judge's training objects' sides: the test bed's, and smaller (models draw them)


def random_scene(rng: np.random.Generator, side: int = SIDE):
    """1-4 objects of any shape and colour (every composition, held-out ones included), placed as the test bed
    places them, their sides anywhere in :data:`READ_SIZES` (wider than the test bed's, so the judge also reads
    what a model draws too small)."""
    from jagg_lightning.testbed.scenes.render import Scene, place

    wanted = [(SHAPES[int(rng.integers(len(SHAPES)))], list(PALETTE)[int(rng.integers(len(PALETTE)))])
              for _ in range(int(rng.integers(1, 5)))]
    objects = place(wanted, rng, side, min_fraction=READ_SIZES[0], max_fraction=READ_SIZES[1])
    return Scene(side, objects, int(rng.integers(96, 161)), 6 if rng.random() < 0.5 else 0, int(rng.integers(2**31)))


MAX_BLUR = 2.0  # px; at 1.2 the judge missed the shipped model's soft triangles (docs/testbed.md)


def degrade(images: Tensor, generator: torch.Generator) -> Tensor:
    """What generated images do that renders do not: blur (sigma up to ``MAX_BLUR``), a contrast and colour change,
    pixel noise (std up to 12 levels). [B, 3, H, W] in [0, 1]."""
    b = len(images)
    sigma = torch.rand(b, generator=generator) * MAX_BLUR
    radius = torch.arange(-4, 5, dtype=torch.float32)
    kernel = torch.exp(-radius[None] ** 2 / (2 * sigma[:, None].clamp_min(1e-3) ** 2))
    kernel = kernel / kernel.sum(1, keepdim=True)  # [B, 9]
    x = images.transpose(0, 1).reshape(3, b, *images.shape[-2:])  # blur each image with its own kernel
    x = F.conv2d(F.pad(x, (4, 4, 0, 0), mode="replicate"), kernel[:, None, None, :], groups=b)
    x = F.conv2d(F.pad(x, (0, 0, 4, 4), mode="replicate"), kernel[:, None, :, None], groups=b)
    x = x.reshape(3, b, *images.shape[-2:]).transpose(0, 1)
    contrast = 1 + (torch.rand(b, 1, 1, 1, generator=generator) - 0.5) * 0.3
    shift = (torch.rand(b, 3, 1, 1, generator=generator) - 0.5) * 0.12
    noise = torch.randn(x.shape, generator=generator) * torch.rand(b, 1, 1, 1, generator=generator) * (12 / 255)
    return ((x - 0.5) * contrast + 0.5 + shift + noise).clamp(0, 1)


def targets(scenes, side: int = SIDE) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(Gaussian-splatted centre heat per shape [B, 4, g, g], colour index [B, g, g] (-100 off centres: ignored),
    offsets [B, 2, g, g], sides [B, 1, g, g], centre mask [B, 1, g, g]) of the scenes' objects (CenterNet's targets;
    sigma one cell)."""
    g = side // STRIDE
    heat = torch.zeros(len(scenes), len(SHAPES), g, g)
    colour = torch.full((len(scenes), g, g), -100, dtype=torch.long)
    offsets, sides, mask = torch.zeros(len(scenes), 2, g, g), torch.zeros(len(scenes), 1, g, g), torch.zeros(
        len(scenes), 1, g, g)
    grid = torch.arange(g, dtype=torch.float32)
    for b, scene in enumerate(scenes):
        for obj in scene.objects:
            cx, cy = obj.x / STRIDE, obj.y / STRIDE
            i, j = min(int(cy), g - 1), min(int(cx), g - 1)
            k = SHAPES.index(obj.shape)
            colour[b, i, j] = COLOURS.index(obj.color)
            splat = torch.exp(-((grid[:, None] - i) ** 2 + (grid[None, :] - j) ** 2) / 2)
            heat[b, k] = torch.maximum(heat[b, k], splat)
            offsets[b, :, i, j] = torch.tensor([cx - j, cy - i])
            sides[b, 0, i, j] = obj.size / side
            mask[b, 0, i, j] = 1
    return heat, colour, offsets, sides, mask


def focal_loss(logits: Tensor, heat: Tensor) -> Tensor:
    """CenterNet's penalty-reduced focal loss (alpha 2, beta 4), normalised by the number of objects."""
    p = logits.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = heat.eq(1).float()
    pos_loss = -(torch.log(p) * (1 - p) ** 2 * pos).sum()
    neg_loss = -(torch.log(1 - p) * p ** 2 * (1 - heat) ** 4 * (1 - pos)).sum()
    return (pos_loss + neg_loss) / pos.sum().clamp_min(1)


def batch_of(rng: np.random.Generator, generator: torch.Generator, size: int, degraded: bool = True):
    from jagg_lightning.testbed.scenes.render import render

    scenes = [random_scene(rng) for _ in range(size)]
    images = torch.from_numpy(np.stack([np.asarray(render(s)) for s in scenes])).permute(0, 3, 1, 2).float() / 255
    return (degrade(images, generator) if degraded else images), scenes


def fit(steps: int, batch_size: int, lr: float, width: int, seed: int, log=print) -> SceneJudge:
    """Adam on fresh random scenes every step (no data set is reused, so nothing is memorised)."""
    torch.manual_seed(seed)
    rng, generator = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    judge = SceneJudge(width)
    optimizer = torch.optim.Adam(judge.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    for step in range(steps):
        images, scenes = batch_of(rng, generator, batch_size)
        heat, colour, offsets, sides, mask = targets(scenes)
        out_heat, out_colour, out_offsets, out_sides = judge(images)
        n = mask.sum().clamp_min(1)
        loss = focal_loss(out_heat, heat) + F.cross_entropy(out_colour, colour, ignore_index=-100) + \
            ((out_offsets - offsets).abs() * mask).sum() / n + 10 * ((out_sides - sides).abs() * mask).sum() / n
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"judge step {step}: loss {loss.item():.4f}")
    return judge.requires_grad_(False).eval()


def accuracy_on_renders(judge: SceneJudge, rows: list[dict], seed: int, degraded: bool) -> dict[str, float]:
    """GenEval's per-task correctness of the judge's reading of scenes rendered to satisfy ``rows`` (every image is
    right, so this is the judge's accuracy), and of the same images against the NEXT row (mostly wrong: the share
    where the judge agrees with the exact reader)."""
    from jagg_lightning.models.conditions import ConditionedPrompt
    from jagg_lightning.rewards.geneval import read_and_judge
    from jagg_lightning.rewards.geneval_rules import task_scores
    from jagg_lightning.rewards.geneval_scenes import SceneReader
    from jagg_lightning.testbed.scenes.render import render, scene_for

    rng, generator = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    images = torch.from_numpy(np.stack([np.asarray(render(scene_for(r, rng))) for r in rows])).permute(0, 3, 1, 2)
    images = images.float() / 255
    if degraded:
        images = degrade(images, generator)
    prompts = [ConditionedPrompt(r["prompt"], origin=f"row {i}", metadata=r) for i, r in enumerate(rows)]
    reader = SceneJudgeReader(judge)
    right = [j.correct for j in read_and_judge(reader, images, prompts, THRESHOLDS)]
    shifted = prompts[1:] + prompts[:1]
    agree = [a.correct == b.correct for a, b in zip(read_and_judge(reader, images, shifted, THRESHOLDS),
                                                    read_and_judge(SceneReader(), images, shifted))]
    scores = task_scores([r["tag"] for r in rows], right)
    scores["agreement_on_mismatched"] = float(np.mean(agree))
    return scores


def save_judge(judge: SceneJudge, args, cpu_s: float) -> dict:
    """Its accuracy on scenes rendered for every train and held-out row (clean, and degraded) into the file's
    metadata with the fit's settings; written to ``args.out`` (a temporary file, then renamed)."""
    from safetensors.torch import save_file

    from jagg_lightning.testbed.scenes.captions import HELDOUT_METADATA, TRAIN_METADATA

    rows = [json.loads(line) for path in (TRAIN_METADATA, HELDOUT_METADATA) for line in path.read_text().splitlines()]
    clean = accuracy_on_renders(judge, rows, args.seed + 1, degraded=False)
    degraded = accuracy_on_renders(judge, rows, args.seed + 2, degraded=True)
    metadata = {"model": "SceneJudge (CenterNet-style heat maps)", "width": str(args.width), "steps": str(args.steps),
                "batch_size": str(args.batch_size), "lr": str(args.lr), "seed": str(args.seed), "cpu_s": f"{cpu_s:.0f}",
                "counting_threshold": str(COUNTING_THRESHOLD), "max_blur": str(MAX_BLUR),
                "rendered_rows": str(len(rows)), "clean": json.dumps(clean), "degraded": json.dumps(degraded)}
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    save_file({k: v.contiguous() for k, v in judge.state_dict().items()}, str(tmp), metadata=metadata)
    os.replace(tmp, out)
    print(f"judge on rendered rows: clean {clean}\ndegraded {degraded}\nwrote {out}")
    return metadata


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(SCENES_JUDGE_PATH))
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    started = time.process_time()
    judge = fit(args.steps, args.batch_size, args.lr, args.width, args.seed)
    return save_judge(judge, args, time.process_time() - started)


if __name__ == "__main__":
    main()
