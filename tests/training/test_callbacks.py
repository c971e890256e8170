"""Each callback inside a real Trainer.fit on the tiny SD3."""

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from PIL import Image

from jagg_lightning.callbacks import ExactnessDiagnostics, RoutingStats, SampleImages
from jagg_lightning.callbacks.exactness import spearman
from jagg_lightning.data import PromptDataModule
from jagg_lightning.method.jagg import check_window_gradients, plan_windows

from toy import setup as toy_setup
from modules import PROMPTS, make_module


def fit(module, steps, callbacks=(), logger=False, root=None, prompts=PROMPTS):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                        default_root_dir=root, log_every_n_steps=1)
    trainer.fit(module, PromptDataModule(prompts=prompts, batch_size=2, seed=1))
    return trainer


@pytest.mark.parametrize("logger_cls", [CSVLogger, TensorBoardLogger])
def test_routing_stats_logs_and_plots(tmp_path, logger_cls, rng_seed):
    module = make_module(rng_seed % 10_000)
    stats = RoutingStats()
    trainer = fit(module, 3, [stats], logger=logger_cls(tmp_path), root=tmp_path)
    png = tmp_path / "lightning_logs" / "version_0" / "routing.png"
    with Image.open(png) as img:
        img.verify()
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size[0] > 200 and img.size[1] > 100
    metrics = trainer.callback_metrics
    assert 0 < float(metrics["routing/routed_share"]) < 1
    # W = 3 over 7 trained steps: 2 full windows, jagg_frac 0.5 routes one -> 3 steps share one pass
    assert float(metrics["routing/backward_saved"]) == 2.0
    freq = stats.routing_frequency()
    assert freq.shape == (len(module.trained_steps),) and freq.max() <= 1 and freq.sum() == 3


def test_exactness_reports_cosine_one_for_w2_and_below_one_for_nonlinear(rng_seed):
    seed = rng_seed % 10_000
    module = make_module(seed)
    module.jagg.window_size = 2
    module.windows = plan_windows(module.trained_steps, 2)
    diag = ExactnessDiagnostics(every_n_steps=1, max_samples=2)
    fit(module, 2, [diag])
    cosines = [c.cosine for step in diag.history for c in step]
    assert len(diag.history) == 2 and cosines
    assert all(abs(c - 1) < 1e-6 for c in cosines), cosines

    nonlinear = make_module(seed)  # W = 3 on the tiny DiT: JAGG is an approximation there
    diag = ExactnessDiagnostics(every_n_steps=1, max_samples=2)
    fit(nonlinear, 1, [diag])
    full = [c for c in diag.history[0] if len(c.steps) > 2]
    # the first window (t near 1) is the least linear: clearly below 1 there, and never exact anywhere
    assert full and min(c.cosine for c in full) < 0.9999
    assert all(c.rel_error > 0 for c in full)


def test_exactness_cosine_one_for_affine_velocity_on_chord(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    model, windows, latents, times, loss_fn, steps, _, _ = toy_setup(4, False, gen, perturb=0.3)
    checks = check_window_gradients(model, list(model.parameters()), latents, times, None, loss_fn, windows)
    assert len(checks) == len([w for w in windows if len(w.steps) >= 2])
    assert all(abs(c.cosine - 1) < 1e-6 and c.rel_error < 1e-8 for c in checks)
    assert all(p.grad is None for p in model.parameters())  # .grad untouched
    # off the chord the same check sees the error
    gen = torch.Generator().manual_seed(rng_seed)
    model, windows, latents, times, loss_fn, steps, _, _ = toy_setup(4, False, gen, perturb=0.3, off_chord=0.3)
    checks = check_window_gradients(model, list(model.parameters()), latents, times, None, loss_fn, windows)
    assert min(c.cosine for c in checks if len(c.steps) > 2) < 1 - 1e-9


def test_training_with_and_without_exactness_callback_is_identical(rng_seed):
    seed = rng_seed % 10_000
    plain, watched = make_module(seed), make_module(seed)
    fit(plain, 3)
    fit(watched, 3, [ExactnessDiagnostics(every_n_steps=1, max_samples=3)])
    for a, b in zip(plain.policy.lora_parameters(), watched.policy.lora_parameters()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(plain.policy.lora_parameters(),
                                                       make_module(seed).policy.lora_parameters()))


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2], [1, 2]) != spearman([1, 2], [1, 2])  # NaN for too few points


def test_sample_images_grid_adapter_off_and_on(tmp_path, rng_seed):
    """At a non-square size: each cell at the images' true aspect (height x width), rows = prompts."""
    module = make_module(rng_seed % 10_000, lr=5e-2, resolution=[32, 48])
    samples = SampleImages(prompts=["a cat", "a dog", "a tree"], every_n_steps=2, dirpath=str(tmp_path / "s"))
    fit(module, 3, [samples], logger=TensorBoardLogger(tmp_path), root=tmp_path)
    assert [p.name for p in samples.written] == ["step_000002.png", "step_000003.png"]
    height, width = module.policy.resolution
    assert (height, width) == (32, 48)
    grid = torch.from_numpy(samples.last_grid).float()  # the unlabelled grid at native size
    assert grid.shape[:2] == (3 * height, 2 * width)
    with Image.open(samples.written[-1]) as img:  # what is written: upscaled (nearest) and labelled
        written = np.asarray(img.convert("RGB"))
    scale = -(-96 // height)
    assert written.shape[0] > 3 * height * scale and written.shape[1] > 2 * width * scale
    layout = samples.last_layout  # each image sits whole in its cell, upscaled
    assert layout.cell == (height * scale, width * scale)
    for r in range(3):
        for c in range(2):
            x0, y0, x1, y1 = layout.cell_box(r, c)
            assert np.array_equal(written[y0:y1:scale, x0:x1:scale],
                                  samples.last_grid[r * height:(r + 1) * height, c * width:(c + 1) * width])
    assert samples.last_marks.correct is None and len(samples.last_marks.captions) == 3  # JPEG: scores, no frames
    off, on = grid[:, :width], grid[:, width:]
    assert (off - on).abs().mean() > 0.5  # the trained adapter changes the image
    # the off column is the base model: an untrained module with the same base draws the same images
    fresh = torch.from_numpy(samples.sample(make_module(rng_seed % 10_000, resolution=[32, 48]))).float()
    assert torch.equal(fresh[:, :width], off)
    assert not torch.equal(fresh[:, width:], on)
    assert list(tmp_path.glob("lightning_logs/version_0/events.out.tfevents.*"))


def test_exactness_warns_about_a_poor_routed_window(rng_seed):
    module = make_module(rng_seed % 10_000, jagg_frac=1.0)  # every full window routed
    with pytest.warns(UserWarning, match=r"JAGG window \(\d+, \d+, \d+\).*min_cosine 1\.0"):
        fit(module, 1, [ExactnessDiagnostics(every_n_steps=1, max_samples=2, min_cosine=1.0)])


def test_callback_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="every_n_steps must be >= 1"):
        ExactnessDiagnostics(every_n_steps=0)
    with pytest.raises(ValueError, match=r"min_cosine must be in \[-1, 1\]"):
        ExactnessDiagnostics(min_cosine=2.0)
    with pytest.raises(ValueError, match="prompts must not be empty"):
        SampleImages(prompts=[])
    with pytest.raises(ValueError, match="exactly one of prompts .* and prompts_file"):
        SampleImages()
    with pytest.raises(ValueError, match="exactly one of prompts .* and prompts_file"):
        SampleImages(prompts=["a cat"], prompts_file="configs/prompts/tiny.txt")
    with pytest.raises(FileNotFoundError, match="no test_metadata.jsonl"):
        SampleImages(prompts_file=str(tmp_path))  # a folder that is not a dataset


def test_sample_images_takes_a_few_rows_of_each_geneval_task():
    """``prompts_per_task`` keeps that many held-out rows of every task, task by task, each with its metadata."""
    from jagg_lightning.rewards.geneval_rules import TASKS

    samples = SampleImages(prompts_file="scenes_heldout", prompts_per_task=2)
    tags = [p.metadata["tag"] for p in samples.prompts]
    assert sorted(tags) == sorted(TASKS * 2) and tags == sorted(tags, key=tags.index)  # grouped by task
    with pytest.raises(ValueError, match="SampleImages.prompts_per_task must be >= 1 or null, got 0"):
        SampleImages(prompts_file="scenes_heldout", prompts_per_task=0)
