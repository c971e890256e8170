"""Conditioned prompts: the JSONL format (and Flow-GRPO's dataset folder), every bad row refused with the row and
the field named, the images travelling with the prompt through batches and pickling, fitted to the sampled size."""

import json
import pickle
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from jagg_lightning.data import PromptDataModule, PromptDataset, unpack_prompt_batch
from jagg_lightning.models.conditions import (
    ConditionedPrompt, check_condition_counts, condition_images, condition_pixels, fit_to, read_conditioned_prompts,
)

ROOT = Path(__file__).resolve().parents[2]


def write_png(path, gen, size=(24, 16)):
    pixels = (torch.rand(size[1], size[0], 3, generator=gen) * 255).round().byte().numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return pixels


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_rows_read_with_paths_relative_to_the_file(tmp_path, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    a = write_png(tmp_path / "data" / "img" / "a.png", gen)
    b = write_png(tmp_path / "data" / "img" / "b.png", gen, size=(8, 8))
    file = write_rows(tmp_path / "data" / "edits.jsonl", [
        {"prompt": " make it red ", "image": "img/a.png", "tag": "kept aside"}, "",
        {"prompt": "two sources", "images": ["img/a.png", str(tmp_path / "data" / "img" / "b.png")]}])
    prompts = read_conditioned_prompts(file, "data.prompts_file")
    assert prompts == ["make it red", "two sources"] and [len(p.images) for p in prompts] == [1, 2]
    assert prompts[1].origin == "edits.jsonl:3"
    first = condition_images(prompts[0])[0]
    assert first.shape == (3, 16, 24) and first.dtype == torch.float32
    torch.testing.assert_close(first, torch.from_numpy(a).permute(2, 0, 1).float() / 255)
    torch.testing.assert_close(condition_images(prompts[1])[1], torch.from_numpy(b).permute(2, 0, 1).float() / 255)
    # the datamodule reads it by suffix; a Flow-GRPO folder by its split's file
    module = PromptDataModule(prompts_file=str(file), val_prompts_file=str(file))
    assert module.prompts == prompts and module.prompts[0].images == prompts[0].images
    write_rows(tmp_path / "data" / "train_metadata.jsonl", [{"prompt": "train row", "image": "img/a.png"}])
    write_rows(tmp_path / "data" / "test_metadata.jsonl", [{"prompt": "test row", "image": "img/b.png"}])
    module = PromptDataModule(prompts_file=str(tmp_path / "data"), val_prompts_file=str(tmp_path / "data"))
    assert module.prompts == ["train row"] and module.val_prompts == ["test row"]


def test_the_shipped_example_reads():
    module = PromptDataModule(prompts_file="configs/prompts/edits", val_prompts_file="configs/prompts/edits")
    assert len(module.prompts) == 4 and len(module.val_prompts) == 2
    assert all(condition_images(p)[0].shape[0] == 3 for p in module.prompts + module.val_prompts)


@pytest.mark.parametrize("row,message", [
    ('{"prompt": "x", "image": "img/a.png"', "not a JSON object"),
    ('["x"]', "a row must be a JSON object"),
    ({"image": "img/a.png"}, "'prompt' must be a non-blank string"),
    ({"prompt": "x", "image": "img/a.png", "images": ["img/a.png"]}, "give one of 'image'.*not both"),
    ({"prompt": "x", "images": []}, "'images' must be a path or a non-empty list"),
    ({"prompt": "x", "image": "img/missing.png"}, "image: no such file .*missing.png"),
    ({"prompt": "x", "images": ["img/a.png", "img/broken.png"]}, "images\\[1\\] .*broken.png.*cannot read the image"),
], ids=["json", "not_object", "prompt", "both", "empty", "missing", "unreadable"])
def test_a_bad_row_is_refused_naming_file_line_and_field(tmp_path, row, message, rng_seed):
    write_png(tmp_path / "img" / "a.png", torch.Generator().manual_seed(rng_seed))
    (tmp_path / "img" / "broken.png").write_bytes(b"\x89PNG not really")
    file = write_rows(tmp_path / "edits.jsonl", [{"prompt": "fine", "image": "img/a.png"}, row])
    with pytest.raises((ValueError, FileNotFoundError), match=f"data.prompts_file \\(.*edits.jsonl, line 2\\): {message}"):
        PromptDataModule(prompts_file=str(file))


def test_counts_are_checked_per_family_naming_the_row():
    prompts = [ConditionedPrompt("a", ["x.png"], "e.jsonl:1"), ConditionedPrompt("b", ["x.png", "y.png"], "e.jsonl:2")]
    check_condition_counts(prompts, (1, 3), "qwen_image_edit_plus", "data.prompts")
    with pytest.raises(ValueError, match="data.prompts: row e.jsonl:2 has 2 condition image\\(s\\); the flux_kontext "
                                         "family takes 1 "):
        check_condition_counts(prompts, (1, 1), "flux_kontext", "data.prompts")
    with pytest.raises(ValueError, match="row 'a cat' has 0 .* takes 1 \\(a JSONL file"):
        check_condition_counts(["a cat"], (1, 1), "flux_kontext", "data.prompts")
    with pytest.raises(ValueError, match="row e.jsonl:1 has 1 .* the sd3 family takes 0 \\(a text-to-image family"):
        check_condition_counts(prompts, (0, 0), "sd3", "data.prompts")


def test_images_travel_with_the_prompt(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    image = torch.rand(3, 8, 8, generator=gen)
    prompts = [ConditionedPrompt("make it red", [image], "e.jsonl:1"), ConditionedPrompt("b", [image * 0.5])]
    batch = next(iter(DataLoader(PromptDataset(prompts), batch_size=2)))
    texts, indices = unpack_prompt_batch(batch)
    assert texts == ["make it red", "b"] and indices == [0, 1]
    assert texts[0].images[0] is image and texts[0].origin == "e.jsonl:1"
    again = pickle.loads(pickle.dumps(texts))
    assert again == texts and torch.equal(again[1].images[0], image * 0.5) and hash(again[0]) == hash("make it red")


def test_fitting_crops_the_centre_then_resizes(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    wide = torch.rand(3, 16, 32, generator=gen)
    torch.testing.assert_close(fit_to(wide, 16, 16), wide[:, :, 8:24])  # the centre square, no resize
    tall = torch.rand(3, 30, 10, generator=gen)
    out = fit_to(tall, 12, 4)  # the same aspect ratio: only resized (bicubic, antialiased, clamped)
    resized = torch.nn.functional.interpolate(tall[None], size=(12, 4), mode="bicubic", antialias=True)[0]
    torch.testing.assert_close(out, resized.clamp(0, 1))
    assert out.shape == (3, 12, 4) and 0 <= out.min() and out.max() <= 1
    pixels = condition_pixels([ConditionedPrompt("x", [wide])], 16, 16)
    assert pixels.shape == (1, 3, 16, 16)
    with pytest.raises(ValueError, match="prompt 'plain' has 0 condition image"):
        condition_pixels(["plain"], 16, 16)


def test_a_family_gets_the_images_it_takes_before_any_model_is_built(tmp_path):
    """`jagg fit` of a text-to-image family on the edits dataset, and of the editing family on plain prompts, stop
    in setup -- before the model is built -- naming the data field, the row and the family's count."""
    from jagg_lightning.cli import cli_main

    base = ["--config", str(ROOT / "configs/flux_kontext_tiny.yaml"), "--trainer.max_steps", "1",
            "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path),
            "--lora_export.dirpath", str(tmp_path / "lora")]
    for extra, message in (
            (["--model.policy.family", "flux"], "data.prompts: row train_metadata.jsonl:1 has 1 condition image\\(s\\); "
                                                "the flux family takes 0"),
            (["--data.prompts_file", str(ROOT / "configs/prompts/tiny.txt")],
             "data.prompts: row 'a cat .*' has 0 condition image\\(s\\); the flux_kontext family takes 1")):
        cli = cli_main(base + extra, run=False)
        with pytest.raises(ValueError, match=message):
            cli.trainer.fit(cli.model, cli.datamodule)
        assert not hasattr(cli.model, "policy")  # refused before configure_model built anything


def test_balance_tasks_draws_the_tasks_alike(tmp_path, rng_seed):
    """data.balance_tasks: every task's rows repeated to about the largest task's count (each row equally often
    within its task); a plain-text prompt list is refused naming the field."""
    import collections
    import random

    rng = random.Random(rng_seed)
    sizes = {task: rng.randint(1, 30) for task in ("single_object", "counting", "color_attr")}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{task} {i}", "tag": task}) + "\n"
                            for task, n in sizes.items() for i in range(n)))
    balanced = PromptDataModule(prompts_file=str(path), balance_tasks=True).prompts
    plain = PromptDataModule(prompts_file=str(path)).prompts
    counts = collections.Counter(p.metadata["tag"] for p in balanced)
    largest = max(sizes.values())
    for task, n in sizes.items():
        assert largest <= counts[task] < largest + n, (rng_seed, task, counts)
        per_row = collections.Counter(str(p) for p in balanced if p.metadata["tag"] == task)
        assert len(per_row) == n and len(set(per_row.values())) == 1, (rng_seed, per_row)
    assert len(plain) == sum(sizes.values())
    with pytest.raises(ValueError, match="data.balance_tasks"):
        PromptDataModule(prompts=["a red circle", "a blue square"], balance_tasks=True)
