"""A newcomer's first hour (issue 18), as subprocesses of the real `jagg` CLI: the main job from another working
directory, then its exported adapter evaluated and sampled, in PEFT and diffusers format. Every command whose whole
stderr is checked (no warning a user cannot act on) is a real `jagg` process; the two that are read only for what
they wrote and printed (base-model sampling, a fit started from the adapter) run in this process."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jagg_lightning.cli.quiet import unexpected_lines

from in_process import jagg_in_process

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "configs" / "digits.yaml"


def jagg(*args, cwd, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run([sys.executable, "-m", "jagg_lightning", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def readme_blocks(language: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def readme_commands() -> dict[str, list[str]]:
    """The `jagg` commands of README's shell blocks, by subcommand, as argument lists."""
    found: dict[str, list[str]] = {}
    for block in readme_blocks("bash"):
        for command in (part.strip() for line in block.splitlines() for part in line.split("&&")):
            if command.startswith("jagg "):
                args = command.split()[1:]
                found.setdefault(args[0], args)
    return found


def table_value(stdout: str, key: str) -> float:
    """A metric from the table `jagg validate` prints."""
    match = re.search(re.escape(key) + r"\s*│\s*([-0-9.e]+)", stdout)
    assert match, stdout[-2000:]
    return float(match.group(1))


@pytest.fixture(scope="module")
def digits_fit(tmp_path_factory):
    """`jagg fit --config configs/digits.yaml` for 2 steps, run from a directory that is not the repository."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    (cwd / "configs").symlink_to(ROOT / "configs")  # README's `--config configs/digits.yaml`; nothing else is here
    assert readme_commands()["fit"] == ["fit", "--config", "configs/digits.yaml"]
    proc = jagg(*readme_commands()["fit"], "--trainer.max_steps", 2, cwd=cwd)  # README's main job, 2 steps
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(cwd / "outputs/digits/lightning_logs/version_0/metrics.csv")))
    evals = [r for r in rows if r.get("val/digit_reward")]
    return cwd, evals, proc


@pytest.mark.subprocess
@pytest.mark.slow
def test_main_job_runs_from_another_directory(digits_fit):
    cwd, evals, proc = digits_fit
    assert unexpected_lines(proc.stderr) == []  # quiet: no warning or info line outside quiet.ALLOWED_STDERR
    assert "step: 2/2" in proc.stdout and "Epoch 0/-2" not in proc.stdout and "v_num" not in proc.stdout
    assert [int(r["step"]) for r in evals] == [0, 2]  # held-out accuracy at the start and the end of fit
    assert (cwd / "outputs/digits/lora/final/peft/adapter_model.safetensors").is_file()
    assert (cwd / "outputs/digits/lora/final/diffusers/pytorch_lora_weights.safetensors").is_file()


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_tiny_config_prints_no_warning(tmp_path):
    """The embedded default as its header says to run it (one step: a rollout, an update, the routing plot and the
    sample grid): stderr holds nothing outside quiet.ALLOWED_STDERR -- no "validation_step but no val_dataloader"
    (tiny.yaml has no held-out prompts, by choice)."""
    proc = jagg("fit", "--config", ROOT / "configs" / "tiny.yaml", "--trainer.max_steps", 1, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert unexpected_lines(proc.stderr) == [], proc.stderr
    assert (tmp_path / "outputs/tiny/lora/final/peft/adapter_model.safetensors").is_file()


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("part", ["", "peft", "diffusers"])
def test_validate_an_exported_adapter_reproduces_what_fit_logged(digits_fit, part):
    cwd, evals, _ = digits_fit
    if part == "":  # README's command as written
        proc = jagg(*readme_commands()["validate"], cwd=cwd)
    else:
        proc = jagg("validate", "--config", DIGITS, "--model.policy.adapter", cwd / "outputs/digits/lora/final" / part,
                    "--trainer.logger", "false", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "untrained base model" not in proc.stderr
    assert unexpected_lines(proc.stderr) == []  # a documented command prints no warning a user cannot act on
    reward = table_value(proc.stdout, "val/digit_reward")
    accuracy = table_value(proc.stdout, "val/digit_accuracy")
    final, base = evals[-1], evals[0]
    # the fit's last evaluation is of the exported weights: same prompts, seeds and batch shapes -> same numbers
    assert reward == pytest.approx(float(final["val/digit_reward"]), rel=1e-6, abs=1e-7)
    assert accuracy == pytest.approx(float(final["val/digit_accuracy"]), abs=1e-7)
    # ... and not the base model's (an adapter that was not loaded would show these)
    assert abs(reward - float(base["val/digit_reward"])) > 1e-4


@pytest.mark.subprocess
@pytest.mark.slow
def test_predict_with_an_adapter_says_what_it_wrote_and_base_sampling_is_announced(digits_fit, tmp_path, capfd,
                                                                                      monkeypatch):
    cwd, _, _ = digits_fit
    proc = jagg(*readme_commands()["predict"], cwd=cwd)  # README's command as written
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted((cwd / "outputs/digits/predictions").glob("*.png"))
    assert unexpected_lines(proc.stderr) == []  # a documented command prints no warning a user cannot act on
    assert len(files) == 30  # the 30 held-out prompts, one sample each
    # the file names carry the prompt (held-out prompt 0 "a handwritten zero", 29 "number 9, handwritten")
    assert ("wrote 30 images (PNG: p00000_s00_a-handwritten-zero.png … p00029_s00_number-9-handwritten.png) to "
            "outputs/digits/predictions/") in proc.stdout
    assert "untrained base model" not in proc.stderr
    # what it prints and writes is all that is read: the base model's sampling runs in this process
    base = jagg_in_process("predict", "--config", DIGITS, "--trainer.default_root_dir", tmp_path / "base",
                           "--data.predict_prompts", "[a handwritten seven]", cwd=cwd, capfd=capfd,
                           monkeypatch=monkeypatch)
    assert base.returncode == 0, base.stderr[-3000:]
    assert "no --ckpt_path and no --model.policy.adapter: sampling the untrained base model" in base.stderr
    assert "wrote 1 image (PNG: p00000_s00_a-handwritten-seven.png)" in base.stdout


@pytest.mark.subprocess
@pytest.mark.slow
def test_training_can_start_from_an_adapter(digits_fit, tmp_path, capfd, monkeypatch):
    """The adapter's weights are the starting point: step 0's held-out evaluation equals the adapter's. (The fit's
    log is what is read: it runs in this process.)"""
    cwd, evals, _ = digits_fit
    proc = jagg_in_process("fit", "--config", DIGITS, "--model.policy.adapter",
                           cwd / "outputs/digits/lora/final/diffusers", "--trainer.max_steps", 1,
                           "--trainer.default_root_dir", tmp_path, "--trainer.logger.init_args.save_dir", tmp_path,
                           "--lora_export.dirpath", tmp_path / "lora", cwd=cwd, capfd=capfd, monkeypatch=monkeypatch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "lightning_logs/version_0/metrics.csv")))
    first = next(r for r in rows if r.get("val/digit_reward"))
    assert int(first["step"]) == 0
    assert float(first["val/digit_reward"]) == pytest.approx(float(evals[-1]["val/digit_reward"]), rel=1e-6)


@pytest.mark.subprocess
@pytest.mark.slow
def test_readme_python_snippets_run_as_written(digits_fit, tmp_path, monkeypatch, capfd):
    """README's drop-in snippet (max_steps shortened to 1) and its diffusers / peft loading snippet, on the
    adapter the main job exported: the loading prints nothing a user cannot act on, and both routes give the same
    merged transformer."""
    import torch

    train, load = readme_blocks("python")
    assert "max_steps=60" in train
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(train.replace("max_steps=60", "max_steps=1"), "README.md (drop-in)", "exec"), scope)
    assert scope["trainer"].global_step == 1 and (tmp_path / "lora/final/peft/adapter_config.json").is_file()

    cwd, _, _ = digits_fit
    monkeypatch.chdir(cwd)
    scope = {}
    capfd.readouterr()
    exec(compile(load, "README.md (loading)", "exec"), scope)
    stderr = capfd.readouterr().err  # the pipeline's own sampling bar (tqdm) is fine; a warning is not
    assert [line for line in unexpected_lines(stderr) if not re.match(r"^\s*\d+%\|", line)] == []
    [image] = scope["images"]
    assert image.size == (32, 32)
    # the peft-merged transformer carries the trained adapter: its weights differ from the shipped base
    from diffusers import SD3Transformer2DModel
    from jagg_lightning.testbed import PIPELINE_DIR

    base = SD3Transformer2DModel.from_pretrained(PIPELINE_DIR, subfolder="transformer")
    merged = scope["transformer"]
    name = "transformer_blocks.0.attn.to_q.weight"
    assert not torch.equal(dict(merged.named_parameters())[name], dict(base.named_parameters())[name])
    fused = dict(scope["pipe"].transformer.named_parameters())  # the diffusers route, fused: the same weights
    for key, value in merged.named_parameters():
        owner, leaf = key.rsplit(".", 1)  # a LoRA-wrapped layer keeps its fused weights as base_layer.*
        torch.testing.assert_close(fused.get(key, fused.get(f"{owner}.base_layer.{leaf}")), value)


def test_configuration_page_lists_every_registered_reward_and_callback():
    import inspect

    import lightning as L

    import jagg_lightning.callbacks as callbacks
    from jagg_lightning.callbacks.progress import StepProgressBar
    from jagg_lightning.rewards import REWARDS

    page = (ROOT / "docs" / "configuration.md").read_text()
    for name in REWARDS:
        assert f"`{name}`" in page, name
    classes = [getattr(callbacks, n) for n in callbacks.__all__ if inspect.isclass(getattr(callbacks, n))]
    for cls in [*classes, StepProgressBar]:
        if issubclass(cls, L.Callback):
            assert f"`{cls.__name__}`" in page, cls.__name__


@pytest.mark.subprocess
@pytest.mark.slow
def test_running_the_main_job_again_names_the_one_flag_and_no_checkpoint_it_lacks(digits_fit, capfd, monkeypatch):
    """The main job writes no checkpoint (enable_checkpointing: false): its refusal offers a folder of its own
    (one flag) or --overwrite, not a --ckpt_path there is nothing for."""
    cwd, _, _ = digits_fit
    proc = jagg_in_process(*readme_commands()["fit"], cwd=cwd, capfd=capfd, monkeypatch=monkeypatch)
    assert proc.returncode == 2
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("jagg")]
    assert line.startswith("jagg: error: lora_export.dirpath: 'outputs/digits/lora' holds an earlier run's adapter "
                           "(final)"), line
    assert "with --trainer.default_root_dir" in line and "--ckpt_path" not in line and "--lora_export" not in line
