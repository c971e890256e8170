"""The model card beside an export (issue 58): the hub's YAML metadata and the run's facts, rendered offline by
huggingface_hub and read back by ``ModelCard.load`` -- what an upload validates. A fit's own card:
tests/cli/test_summary.py."""

import random

import numpy as np
from huggingface_hub import ModelCard
from PIL import Image

from jagg_lightning.callbacks.model_card import CARD_FILE, GRID_FILE, CardFacts, method_name, write_card


def test_the_card_parses_with_its_metadata_and_says_what_trained_it(tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    steps = rng.randrange(2, 500)
    first, last = rng.random(), rng.random()
    grid = tmp_path / "step_000060.png"
    Image.fromarray(np.random.default_rng(rng_seed).integers(0, 255, (8, 16, 3), dtype=np.uint8)).save(grid)
    facts = CardFacts(pipeline="StableDiffusion3Pipeline", base_model="stabilityai/stable-diffusion-3.5-medium",
                      method=method_name("grpo", 0.5), reward="pickscore", steps=steps,
                      settings={"jagg.window_size": 4, "jagg.jagg_frac": 0.5},
                      metrics={"val/judge_accuracy": {0: 0.5, steps: 0.6}, "val/digit_accuracy": {0: first, steps: last},
                               "val/reward_mean": {steps: 0.25}}, grid=grid)
    export = tmp_path / "final"
    export.mkdir()
    card = ModelCard.load(write_card(export, facts))
    assert card.data.base_model == "stabilityai/stable-diffusion-3.5-medium" and card.data.library_name == "diffusers"
    assert {"lora", "text-to-image", "jagg"} <= set(card.data.tags) and "text-to-video" not in card.data.tags
    text = card.text
    assert f"**pickscore**" in text and f"**{steps} steps**" in text and "| `jagg.jagg_frac` | `0.5` |" in text
    rows = [line for line in text.splitlines() if line.startswith("| `val/")]
    # the held-out accuracy first, then the judge, then the rest; first -> last with their steps
    assert rows[0] == f"| `val/digit_accuracy` | {first:.3f} (step 0) | {last:.3f} (step {steps}) |"
    assert rows[1].startswith("| `val/judge_accuracy` |") and rows[2].startswith("| `val/reward_mean` |")
    assert f"]({GRID_FILE})" in text and (export / GRID_FILE).read_bytes() == grid.read_bytes()
    assert "load_lora_adapter(EXPORT + '/diffusers'" in text and "PeftModel.from_pretrained" in text
    assert (export / CARD_FILE).read_text().startswith("---\n")


def test_a_video_model_from_a_local_folder_has_no_hub_base_model(tmp_path):
    """A local base (a folder, a shipped name) is no hub id: no ``base_model`` an upload would refuse; said in the
    text instead. A video family is tagged text-to-video; NFT names its method."""
    facts = CardFacts(pipeline="WanPipeline", base_model=str(tmp_path / "wan"), method=method_name("nft", 0.5),
                      reward="jpeg_compressibility", steps=3, video=True)
    card = ModelCard.load(write_card(tmp_path, facts))
    assert card.data.base_model is None and str(tmp_path / "wan") in card.text
    assert {"text-to-video", "nft"} <= set(card.data.tags) and card.data.pipeline_tag == "text-to-video"
    assert not (tmp_path / GRID_FILE).exists()
