"""What a sample grid shows, on pixels: the digit classifier's right / wrong as green / red frames around real
handwritten digits, the cells whole and upscaled, scores without frames for a reward that cannot say right or wrong,
a legible font, and the names of evaluated weights (an exported adapter's own step)."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from jagg_lightning.rewards import JpegCompressibility
from jagg_lightning.rewards.digits import DigitReward
from jagg_lightning.training.grids import (RIGHT, UNMARKED, WRONG, font, grid_layout, image_grid, labelled_grid, reward_marks,
                                  weights_label)
from jagg_lightning.training.metrics import EvalSums


@pytest.fixture(scope="module")
def threes():
    """Two scikit-learn 8x8 threes the shipped classifier reads as 3, as 32 x 32 RGB images in [0, 1]."""
    data = load_digits()
    images = torch.tensor(data.images[data.target == 3][:40], dtype=torch.float32)[:, None] / 16
    images = F.interpolate(images, scale_factor=4, mode="nearest").expand(-1, 3, -1, -1).contiguous()
    reward = DigitReward()
    read = reward.correct(images, ["a handwritten digit 3"] * len(images))
    assert read.sum() >= 2  # the data check: the classifier reads most threes right
    return reward, images[read][:2]


def frame_colour(picture: np.ndarray, box) -> tuple:
    """The colour just outside the left edge and just above the top edge of a cell (both must agree)."""
    x0, y0, x1, y1 = box
    left, top = tuple(picture[(y0 + y1) // 2, x0 - 2]), tuple(picture[y0 - 2, (x0 + x1) // 2])
    assert left == top
    return left


def test_right_digits_get_green_frames_wrong_ones_red_and_the_cells_stay_whole(threes):
    reward, images = threes
    # row 0: both threes prompted as 3 (right); row 1: the same images prompted as 5 (wrong)
    prompts = ["a handwritten digit 3"] * 2 + ["a handwritten digit 5"] * 2
    cells = torch.cat([images, images])
    marks = reward_marks(reward, cells, prompts, columns=2)
    assert marks.correct == [[True, True], [False, False]]
    assert marks.captions[0] != marks.captions[1]  # each image's score (p of the named digit) under it
    grid = image_grid([list(cells[:2]), list(cells[2:])])
    args = (grid, 32, ["a handwritten digit 3", "a handwritten digit 5"], ["base: 2/2 right", "tuned"])
    picture = labelled_grid(*args, columns=2, marks=marks)
    layout = grid_layout(*args, columns=2, marks=marks)
    assert picture.shape[:2][::-1] == layout.canvas_size()
    scale = layout.scale
    assert scale == 3  # 96 px per image at least
    for r in range(2):
        for c in range(2):
            box = layout.cell_box(r, c)
            assert frame_colour(picture, box) == (RIGHT if r == 0 else WRONG)
            x0, y0, x1, y1 = box
            native = grid[r * 32:(r + 1) * 32, c * 32:(c + 1) * 32]
            assert np.array_equal(picture[y0:y1, x0:x1], native.repeat(scale, 0).repeat(scale, 1))
    # the two column groups do not touch: the second starts after the first's frames and a gap
    assert layout.cell_box(0, 1)[0] > layout.cell_box(0, 0)[2] + 2 * 4


def test_a_reward_without_right_or_wrong_gets_scores_and_no_frames(threes):
    _, images = threes
    reward = JpegCompressibility()
    marks = reward_marks(reward, images, ["a", "b"], columns=2)
    assert marks.correct is None
    assert [float(c) for c in marks.captions[0]] == pytest.approx(reward(images, ["a", "b"]).tolist(), rel=1e-2)
    assert "jpeg_compressibility" in marks.title and "frame" not in marks.title
    grid = image_grid([list(images)])
    picture = labelled_grid(grid, 32, ["row"], ["only"], columns=2, marks=marks)
    box = grid_layout(grid, 32, ["row"], ["only"], columns=2, marks=marks).cell_box(0, 0)
    assert frame_colour(picture, box) == UNMARKED


def test_the_font_is_legible():
    typeface = font(15)
    left, top, right, bottom = typeface.getbbox("Ag 4/8 right")
    assert bottom - top >= 12 and right - left > 60  # Pillow's default bitmap font is 11 px high, 6 px per character


def test_the_evaluation_grid_names_what_was_sampled_and_marks_it(threes):
    reward, images = threes
    sums = EvalSums(grid_images=4)
    prompts = ["a handwritten digit 3", "a handwritten digit 3", "a handwritten digit 8", "a handwritten digit 8"]
    sums.add(torch.cat([images, images]), torch.zeros(4), {}, prompts)
    assert sums.grid_prompts == prompts
    picture = sums.grid_picture(2, "adapter x, step 60", reward)  # two samples per prompt: 2 rows x 2 columns
    greens = np.all(picture == RIGHT, axis=-1).sum()
    reds = np.all(picture == WRONG, axis=-1).sum()
    assert greens > 0 and reds > 0 and abs(int(greens) - int(reds)) < greens // 10  # two framed right, two wrong
    assert picture.shape[0] > 2 * 96 and picture.shape[1] > 2 * 96


def test_weights_label_says_which_adapter_and_step(tmp_path):
    final = tmp_path / "lora" / "final"
    (final / "peft").mkdir(parents=True)
    (final / "adapter.json").write_text(json.dumps({"family": "sd3", "global_step": 60}))
    assert weights_label("validate", 0, None, str(final)) == (f"adapter {final}, step 60", "final_step_000060")
    assert weights_label("validate", 0, None, str(final / "peft"))[1] == "final_step_000060"
    assert weights_label("validate", 0, None, str(tmp_path))[1] == tmp_path.name  # no adapter.json: no step
    assert weights_label("fit", 7, None, str(final)) == ("fine-tuned, step 7", "step_000007")
    assert weights_label("validate", 60, "ckpt/last.ckpt", None) == ("checkpoint ckpt/last.ckpt, step 60",
                                                                     "last_step_000060")
    assert weights_label("test", 0, None, None) == ("base model (no adapter)", "base")


def test_summary_numbers_round_float32_shares_as_their_fractions():
    from jagg_lightning.callbacks.summary import number

    assert number(float(torch.tensor(183 / 240))) == "0.763"  # logged as 0.76249999 (float32)
    assert number(float(torch.tensor(112 / 240))) == "0.467" and number(0.0) == "0.000"
    assert number(1.4e-4) == "0.00014" and number(-1.5466) == "-1.547" and number(123456.0) == "1.235e+05"


def test_conditioned_prompts_show_their_source_before_the_results(threes, rng_seed):
    """Editing / image-to-video: the evaluation grid puts each row's source (fitted to the samples' size) in an
    unframed first column under its own "source" label, then the framed results; the cells stay whole."""
    from jagg_lightning.models.conditions import ConditionedPrompt, fit_to
    from jagg_lightning.training.grids import with_sources

    reward, images = threes
    gen = torch.Generator().manual_seed(rng_seed)
    sources = [torch.rand(3, 40, 56, generator=gen) for _ in range(2)]
    prompts = [ConditionedPrompt(f"a handwritten digit {d}", [s]) for d, s in zip((3, 8), sources)]
    sums = EvalSums(grid_images=4)
    sums.add(torch.cat([images, images]), torch.zeros(4), {}, [p for p in prompts for _ in range(2)])
    picture = sums.grid_picture(2, "fine-tuned", reward)

    rows = [list(images), list(images)]
    marks = reward_marks(reward, torch.cat([images, images]), [p for p in prompts for _ in range(2)], columns=2)
    sourced, shifted, yes = with_sources(rows, prompts, marks)
    assert yes and [len(r) for r in sourced] == [3, 3]
    assert shifted.correct == [[None, True, True], [None, False, False]]
    grid = image_grid(sourced)
    layout = grid_layout(grid, 32, prompts, ["source", "fine-tuned: 2/4 right"], columns=3, marks=shifted,
                         group_sizes=[1, 2])
    assert picture.shape[:2][::-1] == layout.canvas_size()
    s = layout.scale
    for r in range(2):
        x0, y0, x1, y1 = layout.cell_box(r, 0)
        expected = (fit_to(sources[r], 32, 32).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        assert np.array_equal(picture[y0:y1, x0:x1], expected.repeat(s, 0).repeat(s, 1))
        assert frame_colour(picture, (x0, y0, x1, y1)) == UNMARKED
        assert frame_colour(picture, layout.cell_box(r, 1)) == (RIGHT if r == 0 else WRONG)
    # the source group stands apart from the results: a gap, not just the space between two cells
    assert layout.cell_box(0, 1)[0] - layout.cell_box(0, 0)[2] > layout.cell_box(0, 2)[0] - layout.cell_box(0, 1)[2]
    # plain prompts: no source column
    assert with_sources(rows, ["a", "b"], marks) == (rows, marks, False)
