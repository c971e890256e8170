"""One error style (issue 18): every bad value the CLI can see is ONE `jagg: error:` line, exit status 2, naming the
field as the user wrote it and what is allowed -- no traceback, no usage dump. The console entry point run in this
process (its file descriptors captured), and a few cases as real subprocesses of `jagg`."""

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from jagg_lightning.cli.quiet import unexpected_lines

from in_process import jagg_in_process

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "configs" / "digits.yaml"
TINY = ROOT / "configs" / "tiny.yaml"


def jagg(*args, cwd, timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "jagg_lightning", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr
    lines = unexpected_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("jagg: error: "), proc.stderr[-3000:]
    return lines[0]


def typo_config(tmp_path: Path) -> tuple[Path, int]:
    text = DIGITS.read_text().splitlines()
    line = next(i for i, t in enumerate(text) if t.strip().startswith("window_size:"))
    text[line] = text[line].replace("window_size:", "windw_size:")
    path = tmp_path / "typo.yaml"
    path.write_text("\n".join(text) + "\n")
    return path, line + 1


# (subcommand, extra arguments, what the one line must say); {tmp} is the test's directory
CASES = {
    "trainer_range": ("fit", ["--trainer.max_steps", -5], r"trainer\.max_steps must be an integer >= 0.*got -5"),
    "trainer_lightning": ("fit", ["--trainer.devices", 0], r"trainer: .*devices"),
    "trainer_manual_opt": ("fit", ["--trainer.gradient_clip_val", 1.0], r"trainer\.gradient_clip_val must be null.*"
                           r"model\.grpo\.max_grad_norm"),
    "model_range": ("fit", ["--model.jagg.window_size", 9],
                    r"model\.jagg\.window_size must be <= model\.sampling\.trained_steps \(4\), got 9"),
    "model_type": ("fit", ["--model.sampling.group_size", "abc"], r"model\.sampling\.group_size: .*int.*abc"),
    "context_size": ("fit", ["--trainer.strategy", "jagg_lightning.strategies.DDPStrategy",
                             "--trainer.strategy.context_parallel_size", 0],
                     r"^jagg: error: trainer\.strategy\.context_parallel_size must be an integer >= 1, got 0$"),
    "context_kind": ("fit", ["--trainer.strategy", "jagg_lightning.strategies.FSDP2Strategy",
                             "--trainer.strategy.context_parallel_kind", "spiral"],
                     r"^jagg: error: trainer\.strategy\.context_parallel_kind: 'spiral' is not one of ulysses, ring$"),
    "literal": ("fit", ["--model.objective.name", "nfft"],
                r"^jagg: error: model\.objective\.name: 'nfft' is not one of grpo, nft, awm, dgpo, flow_dppo; did you mean nft\?$"),
    "cli_typo": ("fit", ["--model.jagg.windw_size", 3],
                 r"model\.jagg\.windw_size is not a setting; did you mean model\.jagg\.window_size\?"),
    "missing_pretrained": ("fit", ["--model.policy.pretrained", "{tmp}/no_model"],
                           r"model\.policy\.pretrained: no such folder '.*/no_model'"),
    "missing_adapter": ("validate", ["--model.policy.adapter", "outputs/none/lora/final"],
                        r"model\.policy\.adapter: no such folder or file 'outputs/none/lora/final'"),
    "prompts_folder": ("fit", ["--data.prompts_file", "{tmp}"],
                       r"^jagg: error: data\.prompts_file: no train_metadata\.jsonl in the folder '.*' \(a text file"),
    "missing_prompts": ("fit", ["--data.prompts_file", "no_prompts.txt"], r"data\.prompts_file: no such file"),
    "data_range": ("fit", ["--data.batch_size", 0], r"data\.batch_size must be an integer >= 1, got 0"),
    "lora_targets": ("fit", ["--model.policy.lora_targets", "[no_such_module]"],
                     r"model\.policy\.lora_targets \['no_such_module'\] match no layer"),
    "ckpt_missing": ("fit", ["--ckpt_path", "{tmp}/nothing.ckpt"], r"ckpt_path: no such file"),
    "resolution": ("fit", ["--model.policy.resolution", 36],
                   r"model\.policy\.resolution must be a multiple of 8 per side \(.*\), got 36"),
    "resolution_pair": ("fit", ["--model.policy.resolution", "[32, 36]"],
                        r"model\.policy\.resolution must be a multiple of 8 per side \(.*\), got \[32, 36\]"),
}


def run_case(case, tmp_path, run):
    subcommand, extra, _ = CASES[case]
    return run(subcommand, "--config", DIGITS, *[str(a).replace("{tmp}", str(tmp_path)) for a in extra], cwd=tmp_path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_value_is_one_line_naming_the_field(case, tmp_path, capfd, monkeypatch):
    proc = run_case(case, tmp_path, lambda *a, cwd: jagg_in_process(*a, cwd=cwd, capfd=capfd, monkeypatch=monkeypatch))
    line = one_error_line(proc)
    assert re.search(CASES[case][2], line), line


@pytest.mark.parametrize("case", ["cli_typo", "model_range"])
def test_bad_value_is_one_line_from_a_real_jagg_process(case, tmp_path):
    """The same as a subprocess of `jagg` (a parse error, and one found while the objects are built)."""
    line = one_error_line(run_case(case, tmp_path, jagg))
    assert re.search(CASES[case][2], line), line


def test_yaml_typo_names_the_file_line_and_the_closest_key(tmp_path, capfd, monkeypatch):
    path, line_number = typo_config(tmp_path)
    line = one_error_line(jagg_in_process("fit", "--config", path, cwd=tmp_path, capfd=capfd, monkeypatch=monkeypatch))
    assert line == (f"jagg: error: {path} line {line_number}: model.jagg.windw_size is not a setting; did you mean "
                    "model.jagg.window_size?")


@pytest.mark.parametrize("subcommand,field", [("validate", "data.val_prompts"), ("predict", "data.predict_prompts")])
def test_evaluation_without_prompts_is_named(subcommand, field, tmp_path, capfd, monkeypatch):
    line = one_error_line(jagg_in_process(subcommand, "--config", TINY, cwd=tmp_path, capfd=capfd,
                                          monkeypatch=monkeypatch))
    assert f"jagg: error: {field}: jagg {subcommand} needs" in line


@pytest.mark.parametrize("kind", ["random_bytes", "text", "truncated", "not_lightning"])
def test_a_file_that_is_not_a_checkpoint_names_ckpt_path(kind, tmp_path, capfd, monkeypatch):
    path = tmp_path / f"{kind}.ckpt"
    rng = random.Random()
    if kind == "random_bytes":
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(100, 5000))))
    elif kind == "text":
        path.write_text("epoch=3 step=12\n" * rng.randrange(1, 20))
    else:
        torch.save({"state_dict": {"w": torch.randn(64, 64)}, "global_step": 4} if kind == "truncated"
                   else {"weights": torch.randn(3)}, path)
        if kind == "truncated":
            data = path.read_bytes()
            path.write_bytes(data[: rng.randrange(len(data) // 4, 3 * len(data) // 4)])
    line = one_error_line(jagg_in_process("validate", "--config", DIGITS, "--ckpt_path", path, cwd=tmp_path, capfd=capfd,
                                          monkeypatch=monkeypatch))
    assert f"ckpt_path: '{path}' is not a" in line, line


def test_resume_refuses_an_override_and_another_adapters_checkpoint(tmp_path, capfd, monkeypatch):
    """policy.lora_alpha 64 is the default; the checkpoint was trained with 16: refused by name, not ignored.
    Every command runs the console entry point in this process (its exit status and one line are what is read;
    test_bad_value_is_one_line_from_a_real_jagg_process and test_first_hour read real `jagg` processes' stderr)."""
    config = yaml.safe_load(TINY.read_text())
    config["trainer"] |= {"max_steps": 1, "enable_checkpointing": True, "callbacks": None, "logger": False,
                          "enable_progress_bar": False, "default_root_dir": str(tmp_path)}
    config["model"]["sampling"] |= {"num_steps": 4, "group_size": 2, "rollout_batch_size": 4}
    config["model"]["grpo"]["train_batch_size"] = 4
    config["model"]["jagg"]["window_size"] = 2
    config["data"] = {"prompts": ["a red cat", "a blue dog"], "batch_size": 2}
    config["lora_export"] = {"dirpath": str(tmp_path / "lora")}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))

    def here(*args):
        return jagg_in_process(*args, cwd=tmp_path, capfd=capfd, monkeypatch=monkeypatch)

    proc = here("fit", "--config", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [ckpt] = (tmp_path / "checkpoints").glob("*.ckpt")
    line = one_error_line(here("fit", "--config", path, "--ckpt_path", ckpt, "--trainer.max_steps", 2,
                               "--model.policy.lora_alpha", 64))
    assert "model.policy.lora_alpha: checkpoint 16.0, given 64.0" in line, line

    # a checkpoint of another adapter (tiny's, evaluated on the digits model): one line naming ckpt_path, whether
    # the checkpoint's recorded settings tell (before any model is built) or only its weights do (hyper-parameters gone)
    line = one_error_line(here("validate", "--config", DIGITS, "--ckpt_path", ckpt))
    assert f"--ckpt_path {ckpt}: the checkpoint was trained with other model settings" in line
    assert "model.policy.pretrained: checkpoint None, given 'digits'" in line, line
    bare = torch.load(ckpt, weights_only=True)
    del bare["hyper_parameters"]
    torch.save(bare, tmp_path / "bare.ckpt")
    line = one_error_line(here("validate", "--config", DIGITS, "--ckpt_path", tmp_path / "bare.ckpt"))
    assert f"ckpt_path {tmp_path / 'bare.ckpt'}: the checkpoint's adapter does not match" in line, line


def test_version_and_help_say_what_the_tool_is(tmp_path):
    from jagg_lightning import __version__

    version = jagg("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"jagg {__version__}"
    help_text = jagg("--help", cwd=tmp_path).stdout
    assert "GRPO fine-tuning of flow-matching text-to-image transformers" in help_text


class NotInstalled:
    """A meta-path finder for which ``packages`` are not installed: their import fails as a missing module's does and
    their distribution metadata is not found (Lightning asks for it before importing a logger's package)."""

    def __init__(self, packages):
        self.packages = set(packages)

    def _blocked(self, name):
        return name is not None and name.split(".")[0].replace("-", "_").lower() in {p.lower() for p in self.packages}

    def find_spec(self, name, path=None, target=None):
        if self._blocked(name):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

    def find_distributions(self, context=None):
        import importlib.metadata

        if context is not None and self._blocked(context.name):
            raise importlib.metadata.PackageNotFoundError(context.name)
        return iter(())


def without(packages, *jagg_args, cwd) -> subprocess.CompletedProcess:
    """A real `jagg` process in which ``packages`` are not installed."""
    import inspect

    code = "\n".join(["import sys", inspect.getsource(NotInstalled), f"sys.meta_path.insert(0, NotInstalled({packages!r}))",
                      "from jagg_lightning.cli import main", f"main({list(map(str, jagg_args))!r})"])
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def test_the_documented_tensorboard_line_without_tensorboard_names_the_package_to_install(tmp_path):
    """docs/callbacks.md's TensorBoard command before `pip install tensorboard`: one line, not jsonargparse's
    "Does not validate against any of the Union subtypes" with the cause inside."""
    docs = (ROOT / "docs" / "callbacks.md").read_text()
    command = next(line for line in docs.splitlines() if line.startswith("jagg fit") and "TensorBoardLogger" in line)
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # the command's relative --config; its outputs land here
    proc = without(["tensorboard", "tensorboardX"], *command.split()[1:], "--trainer.max_steps", 1, cwd=tmp_path)
    line = one_error_line(proc)
    assert line == ("jagg: error: trainer.logger: lightning.pytorch.loggers.TensorBoardLogger needs the tensorboard "
                    "module, which is not installed: pip install tensorboard"), line


def test_a_reward_by_name_without_its_package_names_the_package_to_install(tmp_path, capfd, monkeypatch):
    for name in [n for n in sys.modules if n.split(".")[0] == "rapidocr_onnxruntime"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NotInstalled(["rapidocr_onnxruntime"]), *sys.meta_path])
    proc = jagg_in_process("fit", "--config", TINY, "--model.reward", "ocr", "--trainer.logger", "false",
                           cwd=tmp_path, capfd=capfd, monkeypatch=monkeypatch)
    assert one_error_line(proc) == ("jagg: error: model.reward: reward ocr needs the rapidocr_onnxruntime module, "
                                    "which is not installed: pip install 'jagg_lightning[ocr]'")
