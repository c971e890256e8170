"""OcrReward: Flow-GRPO's OCR reward on text rendered with Pillow, read by the PP-OCR models inside the
rapidocr-onnxruntime wheel -- with the network closed."""

import copy
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from jagg_lightning.rewards import OcrReward, build_reward, describe_reward
from jagg_lightning.rewards.base import RewardError
from jagg_lightning.rewards.ocr import edit_distance, ocr_score, ocr_target

# the wheel with the models declares Python < 3.13; below that it is in the test extra and must be there
needs_wheel = pytest.mark.skipif(sys.version_info >= (3, 13), reason="rapidocr-onnxruntime supports Python < 3.13")


def render(text: str, size=(320, 128), font_size=40) -> torch.Tensor:
    """Black text centred on white, Pillow's bundled font: [3, H, W] in [0, 1]."""
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_size)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((size[0] - (right - left)) // 2 - left, (size[1] - (bottom - top)) // 2 - top), text, fill="black",
              font=font)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def ocr():
    return OcrReward()


def test_definition_by_hand():
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("sitting", "kitten") == 3
    assert edit_distance("", "abc") == 3 and edit_distance("abc", "abc") == 0
    assert ocr_target('a neon sign that says "Open Late" at night') == "Open Late"
    assert ocr_score("OPEN late", "open Late") == 1.0  # case and spaces do not count
    assert ocr_score("the shop is openlate today", "Open Late") == 1.0  # contained counts as read
    assert ocr_score("garden", "warden") == pytest.approx(1 - 1 / 6)
    assert ocr_score("", "warden") == 0.0
    assert ocr_score("x" * 40, "ab") == 0.0  # the distance is capped at the target's length


@needs_wheel
def test_clear_word_scores_high(ocr):
    images = torch.stack([render("garden"), render("Hello World")])
    scores = ocr(images, ['a sign that says "garden"', 'a poster with "hello world" on it'])
    assert scores.dtype == torch.float32 and scores.shape == (2,)
    assert (scores >= 0.9).all(), (scores, ocr.read(images))


@needs_wheel
def test_one_letter_change_scores_the_formula(ocr):
    image = render("garden")[None]
    assert ocr.read(image) == ["garden"]  # what the formula is applied to
    score = ocr(image, ['a sign that says "warden"'])
    assert score.item() == pytest.approx(1 - 1 / 6, abs=1e-6)  # one substitution in six letters


@needs_wheel
def test_blank_and_noise_score_low(ocr):
    generator = torch.Generator().manual_seed(0)
    images = torch.stack([torch.ones(3, 128, 320), torch.rand(3, 128, 320, generator=generator)])
    scores = ocr(images, ['a sign that says "garden"'] * 2)
    assert (scores <= 0.2).all(), (scores, ocr.read(images))


@needs_wheel
def test_prompt_without_quoted_target_is_an_error_naming_it(ocr):
    image = render("garden")[None]
    with pytest.raises(RewardError, match="prompt 'a sign that says garden' has no target text between double quotes"):
        ocr(image, ["a sign that says garden"])
    with pytest.raises(RewardError, match="no target text"):
        ocr(image, ['an unclosed "garden'])


@needs_wheel
def test_runs_offline_on_the_models_in_the_wheel(monkeypatch):
    import rapidocr_onnxruntime

    models = Path(rapidocr_onnxruntime.__file__).parent / "models"
    assert sorted(p.name for p in models.glob("*.onnx") if "_det_" in p.name or "_rec_" in p.name), models

    def no_network(*args, **kwargs):
        raise OSError("network closed by the test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    reward = OcrReward()  # built and run with every outgoing connection failing
    assert reward(render("garden")[None], ['"garden"']).item() == 1.0


@needs_wheel
def test_registered_by_name_and_checks_its_arguments():
    reward = build_reward("ocr")
    assert isinstance(reward, OcrReward) and describe_reward(reward) == "ocr"
    assert build_reward(OcrReward(text_score=0.3).describe()).text_score == 0.3
    copied = copy.deepcopy(reward)  # as DDP's spawn start method pickles it: the copy loads its own models
    assert copied.engine is not reward.engine and copied(render("garden")[None], ['"garden"']).item() == 1.0
    with pytest.raises(ValueError, match=r"text_score must be in \[0, 1\], got 1.5"):
        OcrReward(text_score=1.5)
    with pytest.raises(ValueError, match="threads must be an integer >= 1, got 0"):
        OcrReward(threads=0)
