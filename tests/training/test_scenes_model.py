"""The shipped scenes model (``jagg_lightning/testbed/scenes_sd3``, the shipped name ``scenes``): it loads in
diffusers' ``StableDiffusion3Pipeline`` and through ``configs/scenes.yaml``, samples 64 px scenes the reader sees
objects in, fits the package's 10 MB and records its recipe (docs/testbed.md, "Scenes")."""

import json
from pathlib import Path

import torch

from jagg_lightning.rewards.geneval_rules import THRESHOLD
from jagg_lightning.rewards.geneval_scenes import SceneReader
from jagg_lightning.testbed.evaluate import module_from_config
from jagg_lightning.testbed.scenes import HELDOUT_METADATA, INFO_PATH, PIPELINE_DIR
from jagg_lightning.testbed.scenes.model import IMAGE_SIZE, MAX_SEQUENCE_LENGTH
from jagg_lightning.testbed.scenes.train import read_rows
from jagg_lightning.utils.assets import find_local

ROOT = Path(__file__).resolve().parents[2]

TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


def rows_per_task(n: int) -> list[dict]:
    rows = read_rows(HELDOUT_METADATA)
    return [row for task in TASKS for row in [r for r in rows if r["tag"] == task][:n]]


def test_shipped_scenes_pipeline_loads_in_diffusers_and_draws_what_the_reader_sees(rng_seed):
    from diffusers import StableDiffusion3Pipeline

    info = json.loads(INFO_PATH.read_text())
    # no T5: diffusers wants the absent components named (docs/testbed.md)
    pipe = StableDiffusion3Pipeline.from_pretrained(str(PIPELINE_DIR), text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    rows = rows_per_task(2)
    gens = [torch.Generator().manual_seed(rng_seed + i) for i in range(len(rows))]
    steps = info["evaluation"]["heldout_cfg1"]["num_steps"]
    images = pipe(prompt=[r["prompt"] for r in rows], num_inference_steps=steps, guidance_scale=1.0,
                  height=IMAGE_SIZE, width=IMAGE_SIZE, generator=gens, output_type="pt",
                  max_sequence_length=info["max_sequence_length"]).images.clamp(0, 1)
    assert images.shape == (len(rows), 3, IMAGE_SIZE, IMAGE_SIZE)
    reader = SceneReader()
    arrays = (images.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy()
    found = [sum(d.score >= THRESHOLD for ds in reader.read(a).values() for d in ds) for a in arrays]
    print(f"shapes the reader reads (confidence >= GenEval's {THRESHOLD}) per image: {found}")
    # the model draws shapes the exact reader reads with GenEval's confidence (a blank canvas or a blob reads as none)
    assert sum(n > 0 for n in found) >= len(rows) // 2


def test_scenes_config_loads_the_shipped_pipeline():
    module, _ = module_from_config(ROOT / "configs" / "scenes.yaml")
    assert find_local("scenes") == PIPELINE_DIR
    assert Path(module.policy.config.pretrained).resolve() == PIPELINE_DIR.resolve()
    info = json.loads(INFO_PATH.read_text())
    channels = info["arguments"]["latent_channels"]
    assert module.policy.latent_shape == (channels, IMAGE_SIZE // 4, IMAGE_SIZE // 4)
    assert module.policy.resolution == (IMAGE_SIZE, IMAGE_SIZE)
    assert module.policy.config.max_sequence_length == MAX_SEQUENCE_LENGTH == info["max_sequence_length"]


def test_shipped_scenes_model_fits_the_package_and_records_its_recipe():
    weights = sum(p.stat().st_size for p in PIPELINE_DIR.rglob("*.safetensors"))
    assert weights <= 10 * 2**20, f"the shipped scenes weights are {weights / 2**20:.1f} MiB (issue 42: <= 10 MB)"
    info = json.loads(INFO_PATH.read_text())
    assert info["recipe"].startswith("python -m jagg_lightning.testbed.scenes.train")
    assert info["transformer"]["steps"] == info["arguments"]["dit_steps"] > 0
    for key in ("heldout_cfg1", "heldout_cfg2", "train_cfg1", "train_cfg2"):
        scores = info["evaluation"][key]
        assert set(TASKS) <= set(scores) and 0.0 <= scores["overall"] <= 1.0
        assert abs(scores["overall"] - sum(scores[t] for t in TASKS) / len(TASKS)) < 1e-3  # GenEval's mean over tasks
