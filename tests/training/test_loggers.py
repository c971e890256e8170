"""TensorBoard, MLflow (local file store) and W&B (offline) each get the scalars, the sample grids, the routing plot
and a video family's video samples -- checked by reading each run back with that tool's own reader. The loggers are
the ones docs/callbacks.md ("Loggers") configures, and its documented command lines are parsed by the real CLI."""

import importlib
import io
import re
import shlex
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import yaml
from PIL import Image

from jagg_lightning.callbacks import RoutingStats, SampleImages
from jagg_lightning.cli import cli_main
from jagg_lightning.data import PromptDataModule

from helpers import TINY_TARGETS
from wandb_records import wandb_history  # W&B itself: the `test` extra installs it

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a red cat", "a blue dog", "a green tree", "a yellow sun"]
pytestmark = pytest.mark.slow


def loggers_section() -> str:
    text = (ROOT / "docs" / "callbacks.md").read_text()
    return text[text.index("## Loggers"):text.index("\n## ", text.index("## Loggers") + 3)]


def documented_loggers(root: Path) -> list[dict]:
    """The YAML block of docs/callbacks.md's logger section, its `outputs/tiny` moved under ``root``."""
    [block] = re.findall(r"```yaml\n(.*?)```", loggers_section(), re.S)
    return yaml.safe_load(block.replace("outputs/tiny", str(root)))["trainer"]["logger"]


def documented_commands() -> list[tuple[dict, list[str]]]:
    """The section's `jagg` command lines: (environment assignments, arguments after `jagg`)."""
    [block] = re.findall(r"```bash\n(.*?)```", loggers_section(), re.S)
    commands = []
    for line in block.strip().splitlines():
        words = shlex.split(line)
        env = dict(w.split("=", 1) for w in words[:words.index("jagg")])
        commands.append((env, words[words.index("jagg") + 1:]))
    return commands


def make_logger(logger: dict):
    module, _, name = logger["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**logger.get("init_args", {}))


@pytest.fixture
def offline(monkeypatch):
    """What the documentation says each tool needs to run without a network or a database."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_documented_command_lines_choose_each_logger(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the lines name configs/tiny.yaml from the repository's root
    commands = documented_commands()
    assert [args[args.index("--trainer.logger") + 1].rpartition(".")[2] for _, args in commands] == [
        "TensorBoardLogger", "MLFlowLogger", "WandbLogger"]
    for env, args in commands:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as info:
            cli_main([*args, "--print_config"])  # parsed, nothing built or run
        assert info.value.code in (0, None)
        logger = yaml.safe_load(capsys.readouterr().out)["trainer"]["logger"]
        assert logger["class_path"] == args[args.index("--trainer.logger") + 1]
        given = {a.removeprefix("--trainer.logger."): yaml.safe_load(v)
                 for a, v in zip(args, args[1:]) if a.startswith("--trainer.logger.")}
        assert given and {k: logger["init_args"][k] for k in given} == given


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    """`jagg fit` of a tiny SD3, 2 steps, validation every step, the documented loggers (all three)."""
    root = tmp_path_factory.mktemp("loggers")
    loggers = documented_loggers(root)
    assert [lg["class_path"].rpartition(".")[2] for lg in loggers] == ["TensorBoardLogger", "MLFlowLogger",
                                                                         "WandbLogger"]
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False, "enable_model_summary": False,
                    "enable_checkpointing": False, "default_root_dir": str(root), "log_every_n_steps": 1,
                    "num_sanity_val_steps": 0, "val_check_interval": 1, "logger": loggers,
                    "callbacks": [{"class_path": "jagg_lightning.callbacks.RoutingStats"},
                                  {"class_path": "jagg_lightning.callbacks.SampleImages",
                                   "init_args": {"prompts": PROMPTS[:2], "every_n_steps": 1, "num_steps": 3}}]},
        "model": {"policy": {"lora_rank": 4, "lora_alpha": 8, "lora_targets": TINY_TARGETS, "guidance_scale": 1.0,
                             "max_sequence_length": 4},
                  "sampling": {"num_steps": 4, "group_size": 2, "rollout_batch_size": 4},
                  "grpo": {"train_batch_size": 4}, "jagg": {"window_size": 2},
                  "evaluation": {"num_steps": 3, "grid_prompts": 2}},
        "data": {"prompts": PROMPTS, "batch_size": 2, "val_prompts": ["a held-out cat", "a held-out dog"]},
        "lora_export": {"dirpath": str(root / "lora")},
    }
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        cli = cli_main(["fit", "--config", str(root / "run.yaml")])
        cli.trainer.loggers[2].experiment.finish()  # W&B writes its run's last records
    return root, cli


def png(path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


def written(cli) -> dict[str, np.ndarray]:
    """The images the run wrote to disk, by logged key: the last of each."""
    log_dir = Path(cli.trainer.log_dir)
    return {"samples": png(log_dir / "samples" / "step_000002.png"), "val/samples": png(log_dir / "samples" /
            "val_step_000002.png"), "routing": png(log_dir / "routing.png")}


SCALARS = ["train/reward_mean", "train/reward/jpeg_compressibility", "routing/routed_share", "val/reward_mean"]


def tensorboard_history(cli, key: str) -> dict[int, float]:
    """A scalar by step as TensorBoard's reader reads it back (the reference the other two must match)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cli.trainer.loggers[0].log_dir)).Reload()
    return {e.step: e.value for e in events.Scalars(key)}


def test_tensorboard_reads_back_scalars_grids_and_routing(image_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, cli = image_run
    events = EventAccumulator(str(cli.trainer.loggers[0].log_dir), size_guidance={"images": 0}).Reload()
    assert set(SCALARS) <= set(events.Tags()["scalars"]), events.Tags()["scalars"]
    rewards = tensorboard_history(cli, "train/reward_mean")
    assert sorted(rewards) == [0, 1]  # one value per training step (logged at the step's global_step)
    assert rewards[1] == pytest.approx(float(cli.trainer.callback_metrics["train/reward_mean"]))
    on_disk = written(cli)
    for key, image in on_disk.items():
        [*_, last] = events.Images(key)
        assert np.array_equal(png(io.BytesIO(last.encoded_image_string)), image), key
    assert [e.step for e in events.Images("samples")] == [1, 2]


def test_mlflow_reads_back_scalars_grids_and_routing(image_run, tmp_path):
    from mlflow import MlflowClient

    _, cli = image_run
    logger = cli.trainer.loggers[1]
    client = MlflowClient(logger._tracking_uri)
    for key in SCALARS:
        history = {m.step: m.value for m in client.get_metric_history(logger.run_id, key)}
        assert history and history == pytest.approx(tensorboard_history(cli, key)), key
    names = [Path(f.path).name for f in client.list_artifacts(logger.run_id, "images")]
    for key, image in written(cli).items():
        stem = key.replace("/", "_")
        mine = [n for n in names if n.startswith(f"{stem}+step+") and n.endswith(".png")]  # (and .webp thumbnails)
        assert mine, (key, names)
        last = max(mine, key=lambda n: int(n.split("+")[2]))
        local = client.download_artifacts(logger.run_id, f"images/{last}", str(tmp_path))
        assert np.array_equal(png(local), image), key


def test_wandb_offline_run_reads_back_scalars_grids_and_routing(image_run):
    root, cli = image_run
    [run_dir] = (root / "wandb").glob("offline-run-*")
    rows = wandb_history(run_dir)
    for key in SCALARS:
        history = {r["trainer/global_step"]: r[key] for r in rows if key in r}
        assert history and history == pytest.approx(tensorboard_history(cli, key)), key
    for key, image in written(cli).items():
        logged = [r for r in rows if f"{key}/_type" in r]
        assert logged and logged[-1][f"{key}/_type"] == "images/separated", (key, sorted({k for r in rows for k in r}))
        assert logged[-1]["trainer/global_step"] == 2
        [file] = logged[-1][f"{key}/filenames"]
        assert np.array_equal(png(run_dir / "files" / file), image), key  # what W&B wrote to its media folder


def test_video_samples_reach_every_logger(tmp_path, offline, rng_seed):
    """A video family (the Wan2.1 twin): SampleImages' grid is a video; each logger gets it as an animated GIF."""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from wan_twins import build, module_for

    build("wan21").save_pretrained(tmp_path / "wan21")
    module = module_for("wan21", tmp_path / "wan21", rng_seed % 10_000, shape={"num_frames": 5})
    loggers = [make_logger(logger) for logger in documented_loggers(tmp_path / "logs")]
    samples = SampleImages(prompts=PROMPTS[:2], every_n_steps=1, num_steps=2, dirpath=str(tmp_path / "samples"))
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=loggers, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[samples, RoutingStats()])
    trainer.fit(module, PromptDataModule(prompts=PROMPTS[:2], batch_size=2, shuffle=False))
    loggers[2].experiment.finish()
    [gif_path] = samples.written
    with Image.open(gif_path) as gif:
        frames = gif.n_frames
    assert gif_path.suffix == ".gif" and frames == 5
    gif = gif_path.read_bytes()

    events = EventAccumulator(str(loggers[0].log_dir), size_guidance={"images": 0}).Reload()
    [summary] = events.Images("samples")
    assert summary.encoded_image_string == gif  # the same animated GIF

    mlflow = MlflowClient(loggers[1]._tracking_uri)
    [video] = mlflow.list_artifacts(loggers[1].run_id, "videos")
    assert Path(video.path).name == "samples_step_000001.gif"
    assert Path(mlflow.download_artifacts(loggers[1].run_id, video.path, str(tmp_path))).read_bytes() == gif

    [run_dir] = (tmp_path / "logs" / "wandb").glob("offline-run-*")
    [row] = [r for r in wandb_history(run_dir) if "samples/_type" in r]
    assert row["samples/_type"] == "videos" and row["trainer/global_step"] == 1, row
    [video] = row["samples/videos"]
    assert video["_type"] == "video-file" and video["path"].endswith(".gif")
    assert (run_dir / "files" / video["path"]).read_bytes() == gif  # what W&B wrote to its media folder
