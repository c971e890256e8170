"""What `jagg fit` and `jagg validate` tell at their end (issue 30): the summary (every val/* metric first -> last,
where the adapter, checkpoints, logs and grids are), below a progress bar that fits 80 columns; sample grids marked by
what the digit classifier reads; the validation grid named after the adapter and step it sampled. In-process runs of
the tiny SD3 (configs/tiny.yaml, 3 steps) rewarded by the digit classifier."""

import csv
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from jagg_lightning.callbacks import LoRAExport, PeakMemory, RunSummary, SampleImages
from jagg_lightning.callbacks.peak_memory import GiB, planned_peak
from jagg_lightning.callbacks.summary import number
from jagg_lightning.cli import cli_main
from jagg_lightning.rewards.digits import DigitReward
from jagg_lightning.training.grids import RIGHT, WRONG

from in_process import jagg_in_process

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ["a handwritten digit 3", "a handwritten digit 7"]


def common(root: Path) -> list[str]:
    """tiny.yaml moved whole into ``root`` by its one flag (the logger's save_dir and the adapter follow it)."""
    return ["--config", str(ROOT / "configs/tiny.yaml"), "--trainer.default_root_dir", str(root),
            "--model.reward", "digits", "--data.prompts_file", "null", "--data.prompts", str(DIGITS),
            "--data.val_prompts", str(DIGITS), "--model.evaluation.num_steps", "4",
            "--model.evaluation.samples_per_prompt", "2", "--model.sampling.group_size", "4",
            "--model.sampling.rollout_batch_size", "8", "--model.grpo.train_batch_size", "8"]


CALLBACKS = ("[{class_path: jagg_lightning.callbacks.SampleImages, init_args: {prompts: "
             f"{DIGITS}, every_n_steps: 2, samples_per_prompt: 2, num_steps: 4}}}}]")


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """3 steps, validation after each, checkpoints on, a SampleImages grid at step 2 and at the end; stdout kept."""
    root = tmp_path_factory.mktemp("summary")
    capture = pytest.MonkeyPatch()
    capture.setenv("COLUMNS", "80")  # rich's width when stdout is not a terminal: the bar is drawn once, at its end
    out = root / "stdout.txt"
    import contextlib
    import io

    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            cli = cli_main(["fit", *common(root), "--trainer.max_steps", "3", "--trainer.val_check_interval", "1",
                            "--trainer.enable_checkpointing", "true", "--trainer.callbacks", CALLBACKS])
    finally:
        capture.undo()
    out.write_text(buffer.getvalue())
    return root, cli, buffer.getvalue()


def test_fit_ends_with_the_metrics_first_to_last_and_where_everything_is(fitted):
    root, cli, stdout = fitted
    [summary] = [c for c in cli.trainer.callbacks if isinstance(c, RunSummary)]
    lines = stdout.splitlines()
    start = lines.index(summary.lines[0])
    assert stdout.count("jagg fit: 3 steps in ") == 1 and re.match(r"jagg fit: 3 steps in (\d+ min )?\d+ s wall, (\d+ min )?\d+ s CPU",
                                                                     lines[start])
    # every val/* metric the CSV logger wrote, first -> last, as the CSV has them
    rows = [r for r in csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")) if r.get("val/reward_mean")]
    assert len(rows) == 3  # after each step (the CSV counts the steps done before it: 0, 1, 2)
    for name in ("val/reward_mean", "val/reward/digits"):
        first, last = float(rows[0][name]), float(rows[-1][name])
        [line] = [x for x in summary.lines if f" {name} " in x]
        assert line.endswith(f"{number(first)} → {number(last)}  (step 1 → 3)"), line
    assert "val-set reward" in next(x for x in summary.lines if " val/reward_mean " in x)
    # the paths it names exist and are this run's
    adapter = next(x for x in summary.lines if x.lstrip().startswith("adapter"))
    [export] = [c for c in cli.trainer.callbacks if isinstance(c, LoRAExport)]
    assert adapter.split()[1] == f"{export.exported['final']}/" == f"{root / 'lora' / 'final'}/"
    assert "(diffusers/, peft/)" in adapter
    # the final adapter supersedes the last checkpoint's: lora/last is gone (nothing of it left beside final)
    assert sorted(p.name for p in (root / "lora").iterdir()) == ["final"] and "last" not in export.exported
    assert Path(cli.trainer.log_dir).is_relative_to(root)  # the logs went where the one flag said
    checkpoints = next(x for x in summary.lines if x.lstrip().startswith("checkpoints"))
    folder, names = checkpoints.split()[1].rstrip(":").rstrip("/"), re.findall(r"[\w=.-]+\.ckpt", checkpoints)
    assert names and all((Path(folder) / n).is_file() for n in names)
    logs = next(x for x in summary.lines if x.lstrip().startswith("logs"))
    assert logs.split()[1] == f"{cli.trainer.log_dir}/"
    [samples] = [c for c in cli.trainer.callbacks if isinstance(c, SampleImages)]
    pictures = "\n".join(summary.lines[summary.lines.index(next(x for x in summary.lines if "images" in x)):])
    assert f"{samples.written[-1].parent}/: " in pictures and "step_000002.png" in pictures
    assert "val_step_000003.png" in pictures and "routing.png" not in pictures  # tiny.yaml's RoutingStats: no plot
    assert (samples.written[-1].parent / "val_step_000003.png").is_file()


def test_every_step_logs_where_its_time_went_and_the_summary_gives_the_shares(fitted):
    """time/<phase> of each step in the CSV log (every logger gets them): the phases add up to the step, and the
    named ones (not `other`: Lightning's loop, logging) cover nearly all of it; the summary's shares are the run's."""
    _, cli, _ = fitted
    rows = [r for r in csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")) if r.get("time/step")]
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    named = ("rollout", "decode", "reward", "update/forward", "update/backward", "optimizer", "collectives",
             "evaluation", "checkpoint")
    for row in rows:
        phases = {name: float(row[f"time/{name}"]) for name in named}
        step, other = float(row["time/step"]), float(row["time/other"])
        assert all(v >= 0 for v in phases.values()) and abs(sum(phases.values()) + other - step) <= 1e-6 * step
        # the named phases hold the step; `other` (Lightning's loop, its checkpoint's state dicts, logging, the data
        # loader) is a small remainder
        assert other <= 0.15 * step, (other, step)
        for busy in ("rollout", "decode", "reward", "update/backward", "evaluation", "checkpoint"):
            assert phases[busy] > 0, busy  # val after each step, a checkpoint (and its LoRA export) after each
        samples = 2 * 4  # two prompts x group_size 4
        assert abs(float(row["time/samples_per_s"]) * step - samples) <= 1e-6 * samples
    [summary] = [c for c in cli.trainer.callbacks if isinstance(c, RunSummary)]
    lines = summary.lines[next(i for i, x in enumerate(summary.lines) if x.lstrip().startswith("time ")):]
    shares = dict(re.findall(r"([a-z/]+) (\d+) %", " ".join(lines)))
    total = sum(float(r["time/step"]) for r in rows)
    biggest = max(named + ("other",), key=lambda n: sum(float(r[f"time/{n}"]) for r in rows))
    assert next(iter(shares)) == biggest  # largest first
    assert abs(int(shares[biggest]) - 100 * sum(float(r[f"time/{biggest}"]) for r in rows) / total) <= 0.5
    assert re.search(r"[\d.]+ samples/s$", lines[-1])


def test_the_final_adapter_has_a_model_card_that_parses_with_the_runs_facts(fitted):
    from huggingface_hub import ModelCard

    root, cli, _ = fitted
    card = ModelCard.load(root / "lora" / "final" / "README.md")
    assert card.data.library_name == "diffusers" and {"lora", "text-to-image", "jagg"} <= set(card.data.tags)
    assert "**digits**" in card.text and "**3 steps**" in card.text
    rows = [r for r in csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")) if r.get("val/reward_mean")]
    first, last = float(rows[0]["val/reward_mean"]), float(rows[-1]["val/reward_mean"])
    assert f"| `val/reward_mean` | {first:.3f} (step 1) | {last:.3f} (step 3) |" in card.text
    [samples] = [c for c in cli.trainer.callbacks if isinstance(c, SampleImages)]
    grid = root / "lora" / "final" / "samples.png"
    assert grid.read_bytes() == samples.written[-1].read_bytes() and "](samples.png)" in card.text
    assert "/diffusers'" in card.text and "/peft')" in card.text


def test_the_progress_bar_fits_80_columns_and_comes_before_the_closing_lines(fitted):
    _, cli, stdout = fitted
    lines = stdout.splitlines()
    [bar] = [i for i, line in enumerate(lines) if "step: 3/3" in line]
    assert "reward:" in lines[bar] and re.search(r"reward: -?\d+\.\d{3}$", lines[bar].rstrip()), lines[bar]
    assert len(lines[bar]) <= 80
    written = next(i for i, line in enumerate(lines) if line.startswith("LoRA adapter written to"))
    summary = next(i for i, line in enumerate(lines) if line.startswith("jagg fit:"))
    assert bar < written < summary  # the adapter's line after the bar's last redraw, the summary last
    assert stdout.count("step: 3/3") == 1


def test_peak_memory_logs_nothing_off_cuda_and_compares_with_jagg_plans_peak(fitted, rng_seed, capfd, monkeypatch):
    """PeakMemory (added to every fit) is silent on a CPU: no memory/* column, no summary line. The plan it compares
    with on CUDA is jagg plan's for this config as this Trainer ran it, to the byte."""
    root, cli, _ = fitted
    [peak] = [c for c in cli.trainer.callbacks if isinstance(c, PeakMemory)]
    [summary] = [c for c in cli.trainer.callbacks if isinstance(c, RunSummary)]
    header = next(csv.reader(open(Path(cli.trainer.log_dir) / "metrics.csv")))
    assert "time/step" in header and not [k for k in header if k.startswith("memory/")], header
    assert peak.summary_line() is None and not [x for x in summary.lines if x.lstrip().startswith("memory")]
    plan = jagg_in_process("plan", *common(root), "--trainer.max_steps", "3", "--json", cwd=ROOT, capfd=capfd,
                           monkeypatch=monkeypatch)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert round(planned_peak(cli.trainer, cli.model)) == json.loads(plan.stdout)["peak_bytes"]
    # what a CUDA run's summary says, from its numbers (fresh ones: the device is not here)
    rng = np.random.default_rng(rng_seed)
    planned, measured = rng.uniform(1, 80) * GiB, rng.uniform(1, 80) * GiB
    shown = PeakMemory()
    shown.device, shown.peak, shown.planned = torch.device("cuda"), int(measured), planned
    assert shown.summary_line() == (f"peak {int(measured) / GiB:.1f} GiB, jagg plan {planned / GiB:.1f} GiB "
                                    f"(measured / planned {int(measured) / planned:.2f})")
    shown.planned, shown.unplanned = None, "ValueError: no memory model"
    assert shown.summary_line() == f"peak {int(measured) / GiB:.1f} GiB (no plan: ValueError: no memory model)"


def test_sample_grid_frames_say_what_the_classifier_reads(fitted):
    _, cli, _ = fitted
    [samples] = [c for c in cli.trainer.callbacks if isinstance(c, SampleImages)]
    grid, layout, marks = samples.last_grid, samples.last_layout, samples.last_marks
    side = grid.shape[0] // len(DIGITS)
    cells = [grid[r * side:(r + 1) * side, c * side:(c + 1) * side] for r in range(2) for c in range(4)]
    images = torch.from_numpy(np.stack(cells)).permute(0, 3, 1, 2).float() / 255
    read = DigitReward().correct(images, [p for p in DIGITS for _ in range(4)]).view(2, 4).tolist()
    assert marks.correct == read  # the marks are the classifier's reading of these very cells
    with Image.open(samples.written[-1]) as img:
        picture = np.asarray(img.convert("RGB"))
    for r in range(2):
        for c in range(4):
            x0, y0, x1, y1 = layout.cell_box(r, c)
            assert tuple(picture[(y0 + y1) // 2, x0 - 2]) == (RIGHT if read[r][c] else WRONG)
            assert tuple(picture[y0 - 2, (x0 + x1) // 2]) == (RIGHT if read[r][c] else WRONG)


def test_a_resumed_fit_says_where_it_resumed_from_and_its_summary_names_that_checkpoint(fitted, tmp_path, capsys):
    root, cli, _ = fitted
    run = tmp_path / "run"
    shutil.copytree(root, run)
    checkpoint = run / Path(cli.trainer.checkpoint_callback.last_model_path or
                            cli.trainer.checkpoint_callback.best_model_path).relative_to(root)
    resumed = cli_main(["fit", *common(run), "--trainer.max_steps", "6", "--trainer.val_check_interval", "1",
                        "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
                        "--trainer.callbacks", CALLBACKS, "--ckpt_path", str(checkpoint)])
    stdout = capsys.readouterr().out
    assert f"jagg fit: resuming from step 3 of {checkpoint}\n" in stdout
    [summary] = [c for c in resumed.trainer.callbacks if isinstance(c, RunSummary)]
    at = next(i for i, x in enumerate(summary.lines) if x.lstrip().startswith("checkpoints"))
    assert summary.lines[at].split(None, 1)[1] == f"resumed from {checkpoint} (step 3)", summary.lines
    assert summary.lines[at + 1].strip() == "none written (trainer.enable_checkpointing: false)"
    assert summary.lines[0].startswith("jagg fit: 3 steps in ")
    # the resumed run logs on in the earlier run's folder (its copy here): its rows kept as they were, this run's after
    folder = Path(resumed.trainer.log_dir)
    assert folder == run / Path(cli.trainer.log_dir).relative_to(root) and not (folder.parent / "version_1").exists()
    earlier = list(csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")))
    rows = list(csv.DictReader(open(folder / "metrics.csv")))
    assert [{k: v for k, v in r.items() if v} for r in rows[:len(earlier)]] == \
        [{k: v for k, v in r.items() if v} for r in earlier]
    timed = [int(r["step"]) for r in rows if r.get("time/step")]
    assert timed == [1, 2, 3, 4, 5, 6], timed  # every step once: none lost, none twice
    assert len([r for r in rows if r.get("val/reward_mean")]) == 6
    # first -> last over both runs: the first value is the earlier run's (its logs), not this run's first
    values = [r for r in rows if r.get("val/reward_mean")]
    [line] = [x for x in summary.lines if " val/reward_mean " in x]
    first, last = float(values[0]["val/reward_mean"]), float(values[-1]["val/reward_mean"])
    assert line.endswith(f"{number(first)} → {number(last)}  (step 1 → 6)"), line
    # the grids keep the run's schedule (every 2 steps: 4 and 6 after a resume at 3, as a run never stopped)
    [samples] = [c for c in resumed.trainer.callbacks if isinstance(c, SampleImages)]
    assert [p.name for p in samples.written] == ["step_000004.png", "step_000006.png"]
    # one folder holds every step: the summary names it once
    [logs] = [x for x in summary.lines if x.lstrip().startswith("logs")]
    assert logs.split(None, 1)[1] == f"{folder}/ (metrics.csv)", summary.lines


def test_validate_an_adapter_names_it_on_the_grid_file_and_in_the_summary(fitted, tmp_path, capsys):
    root, _, _ = fitted
    adapter = root / "lora" / "final"
    cli = cli_main(["validate", *common(tmp_path), "--model.policy.adapter", str(adapter), "--trainer.enable_progress_bar",
                    "false"])
    stdout = capsys.readouterr().out
    grid = Path(cli.trainer.log_dir) / "samples" / "val_final_step_000003.png"  # the adapter's step, not 0
    assert grid.is_file() and not list(grid.parent.glob("val_step_*"))
    [summary] = [c for c in cli.trainer.callbacks if isinstance(c, RunSummary)]
    assert summary.lines[0].startswith(f"jagg validate: adapter {adapter}, step 3 in ") and summary.lines[0] in stdout
    value = float(cli.trainer.callback_metrics["val/reward_mean"])
    assert any(re.search(rf" val/reward_mean +{re.escape(number(value))}$", x) for x in summary.lines), summary.lines
    assert any(f"/samples/: val_final_step_000003.png" in x for x in summary.lines)
    with Image.open(grid) as img:  # labelled, upscaled, framed: not a strip of native-size images
        picture = np.asarray(img.convert("RGB"))
    assert picture.shape[0] > 2 * 96 and picture.shape[1] > 2 * 96
    assert (np.all(picture == RIGHT, axis=-1) | np.all(picture == WRONG, axis=-1)).sum() > 4 * 4 * 96
