"""The scenes model's recipe (``python -m jagg_lightning.testbed.scenes.train``): its word-level tokenizer, its
determinism, and that what it saves is a ``StableDiffusion3Pipeline`` that loads and samples 64 px images.

The recipe runs here at a toy size (a handful of steps of every stage, a few scenes); the full run's numbers are in
docs/testbed.md ("Scenes").
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from jagg_lightning.testbed.scenes import all_metadata
from jagg_lightning.testbed.scenes.model import (IMAGE_SIZE, MAX_SEQUENCE_LENGTH, caption_words, word_tokenizer,
                                                 words_outside)
from jagg_lightning.testbed.scenes.train import main

TINY = ["--scenes-per-task", "6", "--heldout-scenes-per-task", "1", "--vae-steps", "2", "--vae-batch", "2",
        "--dit-steps", "3", "--dit-batch", "4", "--layers", "2", "--eval-steps", "1", "--eval-images-per-task", "2",
        "--eval-train-per-task", "1", "--eval-heldout-per-task", "1", "--eval-every", "2"]
WEIGHTS = ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
           "text_encoder/model.safetensors", "text_encoder_2/model.safetensors")


def tiny_run(folder, seed: int = 0, extra=()):
    main(["--out", str(folder), "--seed", str(seed), *TINY, *extra])
    return {name: load_file(folder / name) for name in WEIGHTS}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scenes") / "run"
    return folder, tiny_run(folder)


def test_word_tokenizer_maps_every_caption_word_to_one_token_and_back():
    rows = all_metadata()
    words = caption_words(rows)
    tokenizer = word_tokenizer(words)
    ids = [tokenizer(w).input_ids for w in words]
    assert all(len(i) == 3 and i[0] == tokenizer.bos_token_id and i[2] == tokenizer.eos_token_id for i in ids)
    assert [i[1] for i in ids] == list(range(3, 3 + len(words)))  # the documented ids, one per word, distinct
    assert [tokenizer.decode([i[1]]).strip() for i in ids] == words
    for row in rows:  # every caption: one token a word, padded to the model length, and back to its text
        encoded = tokenizer(row["prompt"], padding="max_length", max_length=tokenizer.model_max_length).input_ids
        assert len(encoded) == tokenizer.model_max_length
        assert encoded[1:len(row["prompt"].split()) + 1] == [3 + words.index(w) for w in row["prompt"].split()]
        assert tokenizer.decode(encoded, skip_special_tokens=True).split() == row["prompt"].split()


def test_word_tokenizer_splits_unknown_words_and_maps_unknown_characters_to_unk():
    words = caption_words(all_metadata())
    tokenizer = word_tokenizer(words)
    word_ids = set(range(3, 3 + len(words)))
    # a word of caption letters that is no caption word: several sub-word pieces, none a caption word
    pieces = tokenizer("rectangle").input_ids[1:-1]
    assert len(pieces) > 1 and not set(pieces) & word_ids
    # characters in no caption word: <|unk|> (id 2), never the end token the text encoders pool at
    assert tokenizer("z").input_ids == [tokenizer.bos_token_id, tokenizer.unk_token_id, tokenizer.eos_token_id]
    assert tokenizer("zebra").input_ids[1] == tokenizer.unk_token_id
    assert tokenizer.unk_token_id == 2 and tokenizer.convert_ids_to_tokens(2) == "<|unk|>"
    assert words_outside("a photo of a zebra and a Red rectangle", words) == ["zebra", "rectangle"]
    with pytest.raises(ValueError, match="lower-case"):
        word_tokenizer(["Circle"])


@pytest.mark.slow
def test_recipe_is_deterministic(first_run, tmp_path):
    folder, weights = first_run
    again = tiny_run(tmp_path / "again")
    assert all(torch.equal(weights[name][k], again[name][k]) for name in WEIGHTS for k in weights[name])
    first_info = json.loads((folder / "training_info.json").read_text())
    second_info = json.loads((tmp_path / "again" / "training_info.json").read_text())
    assert first_info["transformer"]["flow_loss_curve"] == second_info["transformer"]["flow_loss_curve"]
    assert first_info["evaluation"] == second_info["evaluation"]
    other = tiny_run(tmp_path / "other", seed=1)  # the seed matters: another seed, other weights
    assert not torch.equal(weights[WEIGHTS[0]]["proj_out.weight"], other[WEIGHTS[0]]["proj_out.weight"])


def test_a_run_in_two_sittings_equals_one(first_run, tmp_path):
    """--stop-at ends a sitting with its checkpoint written; --resume continues it to the weights, loss curve,
    held-out curve and evaluations of the uninterrupted run, bit for bit (same machine, same threads)."""
    folder, weights = first_run
    assert main(["--out", str(tmp_path / "run"), *TINY, "--stop-at", "2"]) is None
    assert not (tmp_path / "run").exists() and (tmp_path / "run.sitting.pt").exists()
    with pytest.raises(SystemExit, match="--dit-lr"):  # another run's arguments are refused, naming them
        main(["--out", str(tmp_path / "run"), *TINY, "--resume", "--dit-lr", "0.5"])
    resumed = tiny_run(tmp_path / "run", extra=["--resume"])
    assert all(torch.equal(weights[name][k], resumed[name][k]) for name in WEIGHTS for k in weights[name])
    first_info = json.loads((folder / "training_info.json").read_text())
    info = json.loads((tmp_path / "run" / "training_info.json").read_text())
    for key in ("flow_loss_curve", "heldout_curve_no_cfg", "final_flow_loss"):
        assert info["transformer"][key] == first_info["transformer"][key], key
    assert info["evaluation"] == first_info["evaluation"]
    assert [s["to_step"] for s in info["transformer"]["sittings"]] == [2]
    assert not (tmp_path / "run.sitting.pt").exists()  # a whole run leaves no checkpoint behind
    with pytest.raises(SystemExit, match="no checkpoint"):
        main(["--out", str(tmp_path / "never"), *TINY, "--resume"])


def test_grid_layout_places_one_object_a_cell_and_satisfies_every_row(rng_seed):
    """The grid layout (the scenes model's): every object inside one cell of the 2 x 2 grid, no two in a cell,
    GRID_INSET pixels off its cell's border, and the scene satisfies its row by GenEval's rules."""
    import numpy as np

    from jagg_lightning.rewards.geneval import GenEvalReward
    from jagg_lightning.testbed.scenes.render import GRID, GRID_INSET, OBJECT_SIZES, render, scene_for
    from jagg_lightning.testbed.scenes.train import as_prompts

    rng = np.random.default_rng(rng_seed)
    rows = all_metadata()
    chosen = [rows[int(i)] for i in rng.choice(len(rows), 40, replace=False)]
    scenes = [scene_for(row, rng, IMAGE_SIZE, object_size=OBJECT_SIZES["grid"], layout="grid") for row in chosen]
    cell = IMAGE_SIZE / GRID
    for scene in scenes:
        cells = []
        for obj in scene.objects:
            x0, y0, x1, y1 = obj.box()
            col, row = int(x0 // cell), int(y0 // cell)
            assert x0 >= col * cell + GRID_INSET - 0.5 and x1 <= (col + 1) * cell - GRID_INSET + 0.5, (rng_seed, obj)
            assert y0 >= row * cell + GRID_INSET - 0.5 and y1 <= (row + 1) * cell - GRID_INSET + 0.5, (rng_seed, obj)
            cells.append((row, col))
        assert len(set(cells)) == len(cells), rng_seed
    images = torch.from_numpy(np.stack([np.asarray(render(s)) for s in scenes])).permute(0, 3, 1, 2).float() / 255
    judged = GenEvalReward(reader="scenes").judge_images(images, as_prompts(chosen))
    assert all(j.correct for j in judged), [(r["prompt"], j.reason) for r, j in zip(chosen, judged) if not j.correct]
    with pytest.raises(ValueError, match="layout"):
        scene_for(chosen[0], rng, layout="spiral")


@pytest.mark.parametrize("option,value,recorded,default", [
    ("--timestep-mean", "0", ("timestep_density", "logit-normal(0, 1)"), "logit-normal(1, 1)"),
    ("--lr-schedule", "cosine", ("lr_schedule", "cosine"), "constant")], ids=["timestep_mean", "lr_schedule"])
def test_transformer_options_move_the_transformer_only(first_run, tmp_path, option, value, recorded, default):
    folder, weights = first_run
    changed = tiny_run(tmp_path / "changed", extra=[option, value])
    key, text = recorded
    assert json.loads((tmp_path / "changed" / "training_info.json").read_text())["transformer"][key] == text
    assert json.loads((folder / "training_info.json").read_text())["transformer"][key] == default
    vae = "vae/diffusion_pytorch_model.safetensors"  # the VAE stage does not see it; the transformer does
    assert all(torch.equal(weights[vae][k], changed[vae][k]) for k in weights[vae])
    assert not torch.equal(weights[WEIGHTS[0]]["proj_out.weight"], changed[WEIGHTS[0]]["proj_out.weight"])


@pytest.mark.slow
def test_saved_folder_loads_in_diffusers_and_samples_64px(first_run, rng_seed):
    from diffusers import StableDiffusion3Pipeline

    folder, _ = first_run
    info = json.loads((folder / "training_info.json").read_text())
    assert set(info["evaluation"]) == {"heldout_cfg2", "heldout_cfg1", "train_cfg2", "train_cfg1"}
    assert {"single_object", "color_attr", "overall"} <= set(info["evaluation"]["heldout_cfg1"])
    assert info["image_size"] == IMAGE_SIZE and info["train_cpu_s"] > 0
    assert [point["step"] for point in info["transformer"]["heldout_curve_no_cfg"]] == [2]  # --eval-every 2 of 3
    with pytest.raises(SystemExit, match="exists"):  # a finished run is never overwritten
        main(["--out", str(folder), *TINY])
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    words = info["data"]["vocabulary"]
    assert pipe.tokenizer("a photo of a red circle").input_ids[1:-1] == [3 + words.index(w) for w in
                                                                         "a photo of a red circle".split()]
    images = pipe("a photo of a red circle and a blue square", num_inference_steps=2, guidance_scale=2.0,
                  height=IMAGE_SIZE, width=IMAGE_SIZE, max_sequence_length=MAX_SEQUENCE_LENGTH, output_type="pt",
                  generator=torch.Generator().manual_seed(rng_seed)).images
    assert images.shape == (1, 3, IMAGE_SIZE, IMAGE_SIZE) and torch.isfinite(images).all()
    total = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert total < 10 * 2**20  # the recipe's default size is the limit; the tiny one is far under
