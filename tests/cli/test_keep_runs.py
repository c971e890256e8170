"""Nothing trained is lost (issue 30), through the real `jagg` CLI in-process: a second `fit` into folders that hold an
earlier run's adapter and checkpoints -- one that would finish, or one whose reward fails at a later step -- stops
at start with one line naming the folder and `--overwrite true`, and leaves every file of the first run byte-identical;
resuming writes on into the run's own folder; `--overwrite true` replaces. Abbreviated options are refused as typos
are ("did you mean") in fit, validate, predict, plan and serve-reward. Exports and checkpoints are written with the
permissions the umask gives (not the temporary file's 0600 / folder's 0700)."""

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import jagg_lightning.module as module_lib
from jagg_lightning.callbacks.checkpoint import AtomicCheckpointIO
from jagg_lightning.cli import cli_main, parse_config
from jagg_lightning.cli.plan import plan_main
from jagg_lightning.faults.io import atomic_directory, atomic_write
from jagg_lightning.rewards import JpegCompressibility
from jagg_lightning.rewards.server import serve_main

from helpers import TINY_TARGETS, fresh_seed

PROMPTS = ["a red cat", "a blue dog", "a green tree", "a yellow sun"]
KEPT = ("lora", "ckpt", "checkpoints")  # what a run trains into (relative to its folder)


class FailsAtCall(JpegCompressibility):
    """JPEG compressibility until its ``at_call``-th call (1-based), then NaN scores or a raised error."""

    def __init__(self, at_call: int = 2, kind: str = "nan"):
        super().__init__()
        self.at_call, self.kind, self.calls = at_call, kind, 0

    def score(self, images, prompts):
        self.calls += 1
        if self.calls >= self.at_call:
            if self.kind == "raise":
                raise OSError("scorer went away")
            return torch.full((images.shape[0],), float("nan"))
        return super().score(images, prompts)


def run_config(seed: int, reward=None, steps: int = 2) -> dict:
    """A tiny run whose folders are relative to where it starts: a checkpoint (and lora/last) every step."""
    model = {"policy": {"lora_rank": 4, "lora_alpha": 8, "lora_targets": TINY_TARGETS, "guidance_scale": 1.0,
                        "max_sequence_length": 4},
             "sampling": {"num_steps": 4, "group_size": 2, "rollout_batch_size": 4},
             "grpo": {"train_batch_size": 4}, "jagg": {"window_size": 2}, "seed": seed}
    if reward is not None:
        model["reward"] = reward
    return {
        "trainer": {"accelerator": "cpu", "max_steps": steps, "enable_progress_bar": False, "logger": False,
                    "enable_model_summary": False, "default_root_dir": ".",
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"dirpath": "ckpt", "every_n_train_steps": 1, "save_last": True}}]},
        "model": model,
        "data": {"prompts": PROMPTS, "batch_size": 2},
        "lora_export": {"dirpath": "lora"},
    }


def kept_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for name in KEPT if (root / name).exists()
            for p in sorted((root / name).rglob("*")) if p.is_file()}


def modes(root: Path) -> dict[str, int]:
    """Permission bits of every file and folder a run kept, by relative path."""
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for name in KEPT if (root / name).exists()
            for p in [root / name, *(root / name).rglob("*")]}


def fit_in(root: Path, *args: str, config: str = "run.yaml", umask: int | None = None):
    """`jagg fit --config <config> <args>` started in ``root``."""
    old_cwd, old_mask = os.getcwd(), None if umask is None else os.umask(umask)
    os.chdir(root)
    try:
        return cli_main(["fit", "--config", config, *args])
    finally:
        os.chdir(old_cwd)
        if old_mask is not None:
            os.umask(old_mask)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The earlier run: 2 steps, checkpoints in ckpt/, the adapter in lora/final (lora/last, written at each
    checkpoint, is removed once final supersedes it) (umask 022)."""
    root = tmp_path_factory.mktemp("first")
    seed = fresh_seed(16)
    (root / "run.yaml").write_text(yaml.safe_dump(run_config(seed)))
    cli = fit_in(root, umask=0o022)
    assert cli.trainer.global_step == 2
    assert (root / "lora/final/peft/adapter_model.safetensors").is_file() and (root / "ckpt/last.ckpt").is_file()
    assert sorted(p.name for p in (root / "lora").iterdir()) == ["final"]  # no stale lora/last, no temporary left
    return root, seed, kept_files(root)


def one_error(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jagg")]
    assert len(lines) == 1 and ": error: " in lines[0], lines
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("second", ["finished", "nan_reward_at_step_2", "raising_reward_at_step_2", "with_loggers"])
def test_a_second_fit_is_refused_at_start_and_the_first_runs_files_stay(first_run, second, capsys, monkeypatch):
    """``with_loggers``: MLflow's client writes ``<tracking_uri>/0/meta.yaml`` as it is built; a refused run builds
    no logger (issue 44), so it leaves no folder either."""
    root, seed, before = first_run
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    reward = {"finished": None, "with_loggers": None,
              "nan_reward_at_step_2": {"class_path": "test_keep_runs.FailsAtCall", "init_args": {"at_call": 2}},
              "raising_reward_at_step_2": {"class_path": "test_keep_runs.FailsAtCall",
                                           "init_args": {"at_call": 2, "kind": "raise"}}}[second]
    config = run_config(seed + 1, reward)
    if second == "with_loggers":
        config["trainer"]["logger"] = [
            {"class_path": "lightning.pytorch.loggers.MLFlowLogger", "init_args": {"tracking_uri": "file:mlruns"}},
            {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": "tb"}}]
    (root / f"{second}.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setattr(module_lib, "build_policy", lambda *a, **k: pytest.fail("a model was built"))
    listing = sorted(p.name for p in root.iterdir())
    with pytest.raises(SystemExit) as info:
        fit_in(root, "--trainer.max_steps", "5", config=f"{second}.yaml")  # the new user's command, spelled right
    assert info.value.code == 2
    line = one_error(capsys)
    assert line.startswith("jagg: error: lora_export.dirpath: 'lora' holds an earlier run's adapter (final); a "
                           "new fit does not write over them (nothing was started)"), line
    assert line.endswith("--overwrite true") and "give this run its own folder with --trainer.default_root_dir" in line
    assert f"continue that run with --ckpt_path {root / 'ckpt'}/" in line, line
    assert kept_files(root) == before  # byte for byte
    assert sorted(p.name for p in root.iterdir()) == listing  # and nothing new beside them


@pytest.mark.slow
def test_the_one_flag_the_refusal_names_puts_the_whole_second_run_in_its_own_folder(first_run, tmp_path):
    """``--trainer.default_root_dir second``: the adapter and the checkpoints the config put inside its root ('.')
    follow it; the first run's files stay byte for byte."""
    root, seed, before = first_run
    run = tmp_path / "run"
    shutil.copytree(root, run)
    (run / "second.yaml").write_text(yaml.safe_dump(run_config(seed + 2, steps=1)))
    cli = fit_in(run, "--trainer.default_root_dir", "second", config="second.yaml")
    assert cli.trainer.global_step == 1
    assert kept_files(run) == before
    assert sorted(kept_files(run / "second")) == sorted(k for k in kept_files(run / "second") if k.startswith(
        ("lora/final/", "ckpt/"))) and (run / "second/ckpt/last.ckpt").is_file()
    assert (run / "second/lora/final/peft/adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_checkpoints_alone_are_kept_too(first_run, tmp_path, capsys):
    """An earlier run whose adapter went elsewhere: its checkpoints in the folder this run checkpoints to."""
    root, seed, before = first_run
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run_config(seed)))
    with pytest.raises(SystemExit):
        fit_in(tmp_path)
    line = one_error(capsys)
    assert f"checkpoints: '{tmp_path / 'ckpt'}' holds an earlier run's checkpoints (epoch=0-step=2.ckpt, last.ckpt)" \
        in line, line
    assert kept_files(tmp_path) == {k: v for k, v in before.items() if k.startswith("ckpt/")}


@pytest.mark.slow
def test_resume_writes_on_into_its_own_folder(first_run, tmp_path):
    root, _, _ = first_run
    run = tmp_path / "run"
    shutil.copytree(root, run)
    cli = fit_in(run, "--ckpt_path", "last", "--trainer.max_steps", "3")  # a restarted job's command
    assert cli.trainer.global_step == 3
    assert json.loads((run / "lora/final/adapter.json").read_text())["global_step"] == 3


@pytest.mark.slow
def test_overwrite_true_lets_a_new_run_replace_the_earlier_one(first_run, tmp_path):
    """The switch the refusal names works -- and shows what it protects: a new run that fails at step 2 has already
    written its lora/last (step 1's) beside the earlier run's final when it stops."""
    root, seed, before = first_run
    run = tmp_path / "run"
    shutil.copytree(root, run)
    failing = {"class_path": "test_keep_runs.FailsAtCall", "init_args": {"at_call": 2, "kind": "raise"}}
    (run / "run.yaml").write_text(yaml.safe_dump(run_config(seed + 1, failing)))
    with pytest.raises(RuntimeError, match="scorer went away"):
        fit_in(run, "--overwrite", "true")
    assert json.loads((run / "lora/last/adapter.json").read_text())["global_step"] == 1
    assert kept_files(run)["lora/last/peft/adapter_model.safetensors"] != before["lora/final/peft/adapter_model.safetensors"]


ABBREVIATED = [(["--trainer.max_step", "5"], "trainer.max_step is not a setting; did you mean trainer.max_steps?"),
               (["--trainer.max_step=5"], "trainer.max_step is not a setting; did you mean trainer.max_steps?"),
               (["--model.jagg.window", "3"], "model.jagg.window is not a setting; did you mean model.jagg.window_size?"),
               (["--lora_export.dir", "x"], "lora_export.dir is not a setting; did you mean lora_export.dirpath?")]


@pytest.mark.parametrize("subcommand", ["fit", "validate", "predict"])
@pytest.mark.parametrize("args,message", ABBREVIATED)
def test_an_abbreviated_option_is_refused_as_a_typo(subcommand, args, message, capsys, monkeypatch):
    monkeypatch.setattr(module_lib, "build_policy", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(SystemExit) as info:
        cli_main([subcommand, *args])
    assert info.value.code == 2
    assert one_error(capsys) == f"jagg: error: {message}"


@pytest.mark.parametrize("args,message", [
    (["--trainer.max_step", "5"], "jagg: error: trainer.max_step is not a setting; did you mean trainer.max_steps?"),
    (["--device", "2"], "jagg plan: error: --device is not an option; did you mean --devices?"),
    (["--device-mem", "2"], "jagg plan: error: --device-mem is not an option; did you mean --device-memory?"),
    (["--cont", "2"], "jagg plan: error: --cont is not an option; did you mean --context?"),
])
def test_plan_refuses_abbreviations_of_its_own_and_of_fits_options(args, message, capsys):
    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
    with pytest.raises(SystemExit) as info:
        raise SystemExit(plan_main(["--config", tiny, *args], parse_config))
    assert info.value.code == 2
    assert one_error(capsys) == message


def test_serve_reward_refuses_an_abbreviated_option(capsys):
    with pytest.raises(SystemExit) as info:
        serve_main(["--reward", "jpeg_compressibility", "--max_b", "3"])
    assert info.value.code == 2
    assert one_error(capsys) == "jagg serve-reward: error: --max_b is not an option; did you mean --max_batch?"


@pytest.mark.slow
def test_the_runs_exports_and_checkpoints_have_the_umasks_permissions(first_run):
    root, _, _ = first_run  # written under umask 022
    found = modes(root)
    assert "lora/final/peft/adapter_model.safetensors" in found and "ckpt/last.ckpt" in found
    wrong = {p: oct(m) for p, m in found.items() if m != (0o755 if (root / p).is_dir() else 0o644)}
    assert not wrong, wrong


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o027], ids=["022", "077", "027"])
def test_every_atomic_writer_gives_the_umasks_permissions(umask, tmp_path, rng_seed):
    from safetensors.torch import save_file

    from jagg_lightning.training.images import write_image

    class NoLoggers:
        loggers, global_step = [], 0

    rng = np.random.default_rng(rng_seed)
    old = os.umask(umask)
    try:
        atomic_write(tmp_path / "plain.bin", lambda tmp: Path(tmp).write_bytes(rng.bytes(64)))
        AtomicCheckpointIO().save_checkpoint({"w": torch.from_numpy(rng.standard_normal(4))}, tmp_path / "c.ckpt")
        write_image(NoLoggers(), tmp_path / "grid.png", "grid", rng.integers(0, 255, (8, 8, 3), dtype=np.uint8))
        with atomic_directory(tmp_path / "export") as tmp:
            (tmp / "peft").mkdir()
            (tmp / "peft" / "weights.bin").write_bytes(rng.bytes(64))
            save_file({"w": torch.from_numpy(rng.standard_normal(4))}, str(tmp / "peft" / "w.safetensors"))  # 0600
            atomic_write(tmp / "peft" / "inner.json", lambda t: Path(t).write_text("{}"))
    finally:
        os.umask(old)
    for path in [tmp_path / "plain.bin", tmp_path / "c.ckpt", tmp_path / "grid.png", *(tmp_path / "export").rglob("*"),
                 tmp_path / "export"]:
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == expected, (path.name, oct(path.stat().st_mode))


def test_the_main_jobs_whole_run_follows_its_one_flag():
    """configs/digits.yaml names its logger's save_dir and lora_export.dirpath inside its root: they follow
    ``--trainer.default_root_dir``; a path the command line sets stays where it says."""
    digits = str(Path(__file__).resolve().parents[2] / "configs" / "digits.yaml")
    moved = parse_config(["--config", digits, "--trainer.default_root_dir", "runs/b"])
    assert moved.trainer.logger.init_args.save_dir == "runs/b" and moved.lora_export.dirpath == "runs/b/lora"
    kept = parse_config(["--config", digits, "--trainer.default_root_dir=runs/c", "--lora_export.dirpath", "mine"])
    assert kept.trainer.logger.init_args.save_dir == "runs/c" and kept.lora_export.dirpath == "mine"
    as_written = parse_config(["--config", digits])
    assert as_written.trainer.logger.init_args.save_dir == "outputs/digits"
    assert as_written.lora_export.dirpath == "outputs/digits/lora"


@pytest.mark.parametrize("dies_at", [1, 2])
def test_removing_a_superseded_export_leaves_no_half_folder_and_nothing_to_recover(dies_at, tmp_path, rng_seed,
                                                                                  monkeypatch):
    """``remove_directory`` (what drops lora/last once final is written): each folder is renamed aside before it is
    deleted, so a remover that dies while deleting (the earlier writer's ``.last.old``: ``dies_at`` 1, ``last``
    itself: 2) leaves ``last`` whole or gone, never half; ``.last.old`` goes first (else a later write would recover
    it as ``last``)."""
    import shutil as shutil_lib

    from jagg_lightning.faults.io import readable_path, recover_directory, remove_directory

    rng = np.random.default_rng(rng_seed)
    target = tmp_path / "lora" / "last"
    for folder in (target, tmp_path / "lora" / ".last.old"):
        (folder / "peft").mkdir(parents=True)
        (folder / "peft" / "adapter_model.safetensors").write_bytes(rng.bytes(256))
    whole = (target / "peft" / "adapter_model.safetensors").read_bytes()
    (tmp_path / "lora" / "final").mkdir()
    calls, rmtree = [], shutil_lib.rmtree

    def dies(path, ignore_errors=False):  # the remover killed half-way through deleting its dies_at-th folder
        calls.append(path)
        if len(calls) == dies_at:
            next(p for p in Path(path).rglob("*") if p.is_file()).unlink()
            raise KeyboardInterrupt
        rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil_lib, "rmtree", dies)
    with pytest.raises(KeyboardInterrupt):
        remove_directory(target)
    monkeypatch.undo()
    recover_directory(target)  # what the next write does first
    found = readable_path(target)
    assert (not found.exists()) if dies_at == 2 else (found / "peft/adapter_model.safetensors").read_bytes() == whole
    remove_directory(target)
    recover_directory(target)
    assert not readable_path(target).exists() and (tmp_path / "lora" / "final").is_dir()
