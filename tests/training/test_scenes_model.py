"""The shipped scenes model (``jagg_lightning/testbed/scenes_sd3``, the shipped name ``scenes``): it loads in
diffusers' ``StableDiffusion3Pipeline`` and through ``configs/scenes.yaml``, samples 64 px scenes the reader sees
objects in, fits the package's 10 MB and records its recipe (docs/testbed.md, "Scenes")."""

import json
from pathlib import Path

import pytest
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


SCENES_PRESETS = sorted(p.name for p in (ROOT / "configs").glob("scenes*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("preset", SCENES_PRESETS)
def test_a_scenes_preset_trains_two_steps(preset, tmp_path, capfd, monkeypatch, rng_seed):
    """Each scenes preset runs `jagg fit` for two optimizer steps on the shipped model, at small batch sizes and
    without its held-out callbacks (hundreds of samples each): the LoRA it exports moved off the base."""
    import yaml
    from safetensors.torch import load_file

    from in_process import jagg_in_process

    config = yaml.safe_load((ROOT / "configs" / preset).read_text())
    config["trainer"]["callbacks"] = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("RoutingStats")]
    config["seed_everything"] = rng_seed
    path = tmp_path / preset
    path.write_text(yaml.safe_dump(config))
    proc = jagg_in_process("fit", "--config", path, "--trainer.max_steps", 2, "--data.batch_size", 2,
                           "--model.sampling.group_size", 4, "--model.sampling.rollout_batch_size", 8,
                           "--model.grpo.train_batch_size", 8, "--trainer.default_root_dir", tmp_path / "out",
                           "--trainer.logger.init_args.save_dir", tmp_path / "out", "--lora_export.dirpath",
                           tmp_path / "lora", cwd=ROOT, capfd=capfd, monkeypatch=monkeypatch)
    assert proc.returncode == 0, (rng_seed, proc.stderr[-3000:])
    weights = load_file(next((tmp_path / "lora" / "final").rglob("*.safetensors")))
    moved = [name for name, w in weights.items() if "lora_B" in name and w.abs().max() > 0]
    assert moved, f"{preset}: no LoRA B matrix left zero-init after two steps (seed {rng_seed})"
