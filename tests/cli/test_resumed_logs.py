"""A resumed fit's loggers (cli/resumed_logs.py): the CSV continues in the earlier run's version folder without the rows
a crashed run logged past its checkpoint; TensorBoard gets the same folder and a purge step. Real Lightning loggers on
a metrics.csv written here (the whole fit + resume: tests/cli/test_summary.py)."""

import csv
import random
from pathlib import Path

import pytest
from lightning.pytorch.cli import instantiate_class
from lightning.pytorch.loggers import CSVLogger

from jagg_lightning.cli.resumed_logs import ASIDE, continue_csv, continued_spec

CSV = "lightning.pytorch.loggers.CSVLogger"
TENSORBOARD = "lightning.pytorch.loggers.TensorBoardLogger"


def earlier_logs(folder: Path, last: int, rng: random.Random) -> list[dict]:
    """What a run logged up to step ``last``: a time row per step and a validation row every other step."""
    rows = []
    for step in range(1, last + 1):
        rows.append({"step": str(step), "time/step": repr(rng.random())})
        if step % 2 == 0:
            rows.append({"step": str(step - 1), "val/reward_mean": repr(rng.random())})
    folder.mkdir(parents=True)
    with open(folder / "metrics.csv", "w", newline="") as file:
        out = csv.DictWriter(file, fieldnames=sorted({k for r in rows for k in r}))
        out.writeheader()
        out.writerows(rows)
    return rows


def read(path: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if v} for row in csv.DictReader(open(path, newline=""))]


@pytest.mark.parametrize("aside", [False, True], ids=["as_left", "after_a_crash_while_continuing"])
def test_the_csv_continues_after_the_checkpoint_step_without_later_rows(rng_seed, tmp_path, aside):
    rng = random.Random(rng_seed)
    checkpoint_step, crashed_at = rng.randint(2, 6), rng.randint(7, 10)
    folder = tmp_path / "lightning_logs" / "version_0"
    rows = earlier_logs(folder, crashed_at, rng)
    if aside:  # a crash between moving metrics.csv aside and writing it back: the rows are found there
        (folder / "metrics.csv").rename(folder / ("metrics.csv" + ASIDE))
    spec = continued_spec({"class_path": CSV, "init_args": {"save_dir": str(tmp_path)}}, (checkpoint_step, folder))
    assert spec["init_args"]["version"] == "version_0"
    logger = instantiate_class((), spec)
    assert isinstance(logger, CSVLogger) and Path(logger.log_dir) == folder
    continue_csv(logger, checkpoint_step)
    later = [{"time/step": rng.random(), "val/judge": rng.random()} for _ in range(checkpoint_step, crashed_at + 1)]
    for step, values in enumerate(later, start=checkpoint_step + 1):
        logger.log_metrics(values, step=step)  # a key the earlier run never logged: the header grows
    logger.save()
    kept = [r for r in rows if int(r["step"]) <= checkpoint_step]
    expected = kept + [{k: repr(v) for k, v in values.items()} | {"step": str(step)}
                       for step, values in enumerate(later, start=checkpoint_step + 1)]
    assert read(folder / "metrics.csv") == expected
    assert not (folder / ("metrics.csv" + ASIDE)).exists() and not list(tmp_path.glob("lightning_logs/version_1"))


def test_tensorboard_gets_the_folder_and_hides_the_steps_past_the_checkpoint(rng_seed, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rng = random.Random(rng_seed)
    checkpoint_step, crashed_at = rng.randint(2, 6), rng.randint(7, 10)
    save_dir = tmp_path / "tb"
    earlier = instantiate_class((), {"class_path": TENSORBOARD, "init_args": {"save_dir": str(save_dir), "name": "run"}})
    for step in range(1, crashed_at + 1):
        earlier.log_metrics({"train/reward": rng.random()}, step=step)
    earlier.finalize("failed")
    folder = Path(earlier.log_dir)
    spec = continued_spec({"class_path": TENSORBOARD, "init_args": {"save_dir": str(save_dir), "name": "run"}},
                          (checkpoint_step, folder))
    assert spec["init_args"]["version"] == folder.name and spec["init_args"]["purge_step"] == checkpoint_step + 1
    logger = instantiate_class((), spec)
    assert Path(logger.log_dir) == folder
    later = {step: rng.random() for step in range(checkpoint_step + 1, crashed_at + 2)}
    for step, value in later.items():
        logger.log_metrics({"train/reward": value}, step=step)
    logger.finalize("success")
    events = EventAccumulator(str(folder))
    events.Reload()
    steps = [e.step for e in events.Scalars("train/reward")]
    assert steps == list(range(1, crashed_at + 2)), steps  # each step once: the crashed run's later ones hidden
    assert [e.value for e in events.Scalars("train/reward")][checkpoint_step:] == pytest.approx(list(later.values()))


def test_a_logger_that_names_its_version_or_another_folder_starts_its_own(tmp_path):
    folder = tmp_path / "lightning_logs" / "version_0"
    folder.mkdir(parents=True)
    named = {"class_path": CSV, "init_args": {"save_dir": str(tmp_path), "version": "mine"}}
    assert continued_spec(named, (3, folder)) == named
    elsewhere = {"class_path": CSV, "init_args": {"save_dir": str(tmp_path / "other")}}
    assert continued_spec(elsewhere, (3, folder)) == elsewhere
    assert continued_spec(elsewhere, (3, None)) == elsewhere  # a checkpoint that does not say where its run logged
    other = {"class_path": "lightning.pytorch.loggers.MLFlowLogger", "init_args": {"save_dir": str(tmp_path)}}
    assert continued_spec(other, (3, folder)) == other
