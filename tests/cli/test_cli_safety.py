"""The CLI as a user meets it: bad values named before any model is built, configs that re-run, resume
that honours (or refuses) overrides, precision, validate / predict, images to loggers."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.loggers import Logger
from PIL import Image
from torch.utils.data import DataLoader

import jagg_lightning.module as module_lib
from jagg_lightning.cli import cli_main
from jagg_lightning.data import PromptDataModule
from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.config import image_size
from jagg_lightning.policies import PolicyConfig
from jagg_lightning.policies.sd3 import SD3Policy
from jagg_lightning.rewards import JpegCompressibility, Reward, WeightedReward

from helpers import TINY_TARGETS, randomize_lora_b, tiny_policy_config
from launch import search_path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a red cat", "a blue dog", "a green tree", "a yellow sun"]


def small_config(root: Path, **extra) -> dict:
    """A two-step CPU run of a tiny model, small enough for a test."""
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False, "enable_model_summary": False,
                    "default_root_dir": str(root), "log_every_n_steps": 1, "num_sanity_val_steps": 0,
                    "logger": [{"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                "init_args": {"save_dir": str(root)}},
                               {"class_path": "test_cli_safety.ImageListLogger"}],
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"dirpath": str(root / "ckpt"), "every_n_train_steps": 1,
                                                 "save_last": True}},
                                  {"class_path": "jagg_lightning.callbacks.RoutingStats"}]},
        "model": {"policy": {"lora_rank": 4, "lora_alpha": 8, "lora_targets": TINY_TARGETS, "guidance_scale": 1.0,
                             "max_sequence_length": 4},
                  "sampling": {"num_steps": 4, "group_size": 2, "rollout_batch_size": 4},
                  "grpo": {"train_batch_size": 4}, "jagg": {"window_size": 2},
                  "evaluation": {"num_steps": 3, "grid_prompts": 2}},
        "data": {"prompts": PROMPTS, "batch_size": 2, "val_prompts": ["a held-out cat", "a held-out dog", "a boat"]},
        "lora_export": {"dirpath": str(root / "lora")},
    }
    for key, value in extra.items():
        section, _, field = key.partition(".")
        config[section][field] = value
    return config


class ImageListLogger(Logger):
    """A user's own logger with the W&B-style ``log_image(key, images, step)``: it must get every image."""

    def __init__(self):
        super().__init__()
        self.images: dict[str, list] = {}

    name = "images"
    version = 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_image(self, key, images, step=None):
        self.images.setdefault(key, []).extend(images)


def write(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def no_model(monkeypatch):
    """Any attempt to build the policy fails the test: bad values must be caught before."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the bad value was reported")

    monkeypatch.setattr(module_lib, "build_policy", refuse)


@pytest.mark.parametrize("args,message", [
    (["--model.sampling.noise_level", "0"], "sampling.noise_level must be in (0, 2]"),
    (["--model.sampling.rollout_batch_size", "0"], "sampling.rollout_batch_size must be >= 1"),
    (["--model.policy.lora_rank", "0"], "policy.lora_rank must be an integer >= 1"),
    (["--model.policy.lora_rank", "2.5"], "model.policy.lora_rank"),
    (["--model.policy.guidance_scale", "0.5"], "policy.guidance_scale must be >= 1.0"),
    (["--model.policy.dtype", "float8"], "policy.dtype must be one of"),
    (["--model.policy.compile", "full"], "policy.compile must be null (eager) or 'repeated_blocks'"),
    (["--model.policy.resolution", "0"], "policy.resolution must be [height, width] (integers >= 1, pixels)"),
    (["--model.policy.resolution", "-32"], "policy.resolution must be [height, width] (integers >= 1, pixels)"),
    (["--model.policy.resolution", "[480]"], "policy.resolution must be [height, width]"),
    (["--model.policy.resolution", "[480, 0]"], "policy.resolution must be [height, width]"),
    (["--model.jagg.window_size", "12"], "model.jagg.window_size must be <= model.sampling.trained_steps"),
    (["--model.evaluation.num_steps", "0"], "evaluation.num_steps must be >= 1"),
    (["--model.sampling.ode_solver", "heun"], "sampling.ode_solver must be 'euler' or 'dpmpp_2m'"),
    (["--model.sampling.ode_steps", "3"], "sampling.ode_steps must be null unless model.sampling.ode_after_trained true"),
    (["--model.sampling.ode_after_trained", "true", "--model.sampling.trained_steps", "4", "--model.sampling.ode_steps",
      "0"], "sampling.ode_steps must be in [1, 6]"),
    (["--data.prompts", "a cat"], "data.prompts must be a list of strings"),
    (["--data.prompts", "['a cat', '  ']"], "data.prompts[1] must be a non-blank string"),
    (["--trainer.precision", "bf16-true"], "model.policy.dtype must be 'bfloat16' with trainer.precision bf16-true"),
    (["--trainer.precision", "transformer-engine"], "trainer.precision must be one of"),
    (["--trainer.precision", "16-mixed"], "trainer.precision must be bf16-mixed rather than 16-mixed"),
])
def test_bad_value_through_cli_is_named_before_any_model(args, message, no_model, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["fit", *args])
    assert info.value.code != 0
    err = capsys.readouterr().err
    assert message in err, err[-1500:]
    assert "Does not validate against any of the Union subtypes" not in err


def test_printed_config_is_complete_and_reruns(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["fit", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    for section in ("policy", "sampling", "grpo", "jagg", "evaluation"):
        assert isinstance(printed["model"][section], dict) and printed["model"][section], section
    assert printed["model"]["optimizer"] is None and printed["trainer"]["plugins"] is None
    # the bare defaults run as printed (only made small enough for a test)
    small = small_config(tmp_path)
    printed["model"]["policy"] |= small["model"]["policy"]
    printed["model"]["sampling"] |= small["model"]["sampling"]
    printed["model"]["grpo"] |= small["model"]["grpo"]
    printed["model"]["jagg"] |= small["model"]["jagg"]
    printed["trainer"] |= {"max_steps": 1, "accelerator": "cpu", "default_root_dir": str(tmp_path),
                           "enable_progress_bar": False, "logger": False, "enable_checkpointing": False}
    printed["lora_export"]["dirpath"] = str(tmp_path / "lora")
    cli = cli_main(["fit", "--config", str(write(tmp_path / "printed.yaml", printed))])
    assert cli.trainer.global_step == 1
    assert (tmp_path / "lora" / "final" / "peft" / "adapter_model.safetensors").is_file()


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """`jagg fit` of the small config with validation every step: shared by the tests below."""
    root = tmp_path_factory.mktemp("cli_run")
    config = small_config(root, **{"trainer.val_check_interval": 1})
    config["trainer"]["logger"].append({"class_path": "lightning.pytorch.loggers.MLFlowLogger",
                                        "init_args": {"tracking_uri": f"file:{root / 'mlruns'}"}})
    config = write(root / "run.yaml", config)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 wants a database unless told; a test has none
        cli = cli_main(["fit", "--config", str(config)])
    return root, config, cli


def test_fit_validates_logs_every_component_and_images_to_tensorboard(cli_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, _, cli = cli_run
    metrics = cli.trainer.callback_metrics
    for key in ("val/reward_mean", "val/reward/jpeg_compressibility", "train/reward/jpeg_compressibility"):
        assert key in metrics, sorted(metrics)
    # one reward: its own name and the mean are the same number
    assert float(metrics["val/reward_mean"]) == pytest.approx(float(metrics["val/reward/jpeg_compressibility"]))
    grids = sorted((Path(cli.trainer.log_dir) / "samples").glob("val_step_*.png"))
    assert grids
    assert grids[-1].name == f"val_step_{cli.trainer.global_step:06d}.png"
    with Image.open(grids[-1]) as img:  # grid_prompts 2, one sample each: upscaled to 96 px at least, labelled
        height, width = cli.model.policy.resolution
        assert img.size[0] > width * 96 // height and img.size[1] > 2 * 96
    events = EventAccumulator(str(cli.trainer.log_dir), size_guidance={"images": 0}).Reload()
    assert {"val/samples", "routing"} <= set(events.Tags()["images"]), events.Tags()["images"]
    own = cli.trainer.loggers[1].images  # and any other logger that takes images
    assert {"val/samples", "routing"} <= set(own)
    with Image.open(grids[-1]) as img:
        last_grid = np.asarray(img.convert("RGB"))
    assert np.array_equal(own["val/samples"][-1], last_grid)
    mlflow = cli.trainer.loggers[2]  # MLflow: a PNG artifact of the logger's own run per image logged
    artifacts = Path(mlflow.save_dir) / mlflow.experiment_id / mlflow.run_id / "artifacts" / "images"
    for key in ("val/samples", "routing"):
        assert len(list(artifacts.glob(f"{key.replace('/', '_')}+step+*.png"))) == len(own[key]), key
    last_step = cli.trainer.global_step
    [logged] = artifacts.glob(f"val_samples+step+{last_step}+*[0-9a-f].png")
    with Image.open(logged) as img:
        assert np.array_equal(np.asarray(img.convert("RGB")), last_grid)


def test_saved_config_reruns(cli_run, tmp_path):
    root, _, cli = cli_run
    saved = yaml.safe_load((Path(cli.trainer.log_dir) / "config.yaml").read_text())
    saved["trainer"] |= {"max_steps": 1, "default_root_dir": str(tmp_path), "logger": False, "callbacks": None,
                         "enable_checkpointing": False, "val_check_interval": None}
    saved["lora_export"]["dirpath"] = str(tmp_path / "lora")
    again = cli_main(["fit", "--config", str(write(tmp_path / "saved.yaml", saved))])
    assert again.trainer.global_step == 1
    assert yaml.safe_load((Path(cli.trainer.log_dir) / "hparams.yaml").read_text())["policy"]["lora_rank"] == 4
    loaded = JAGGModule.load_from_checkpoint(root / "ckpt" / "last.ckpt")  # a CLI checkpoint rebuilds as configured
    assert loaded.policy_config.lora_rank == 4 and loaded.evaluation.grid_prompts == 2
    for a, b in zip(cli.model.policy.lora_parameters(), loaded.policy.lora_parameters()):
        assert torch.equal(a.detach(), b.detach())


def test_resume_applies_safe_overrides_and_refuses_unsafe_ones(cli_run, tmp_path, capsys, monkeypatch):
    root, config, _ = cli_run
    ckpt = str(root / "ckpt" / "last.ckpt")
    common = ["--config", str(config), "--ckpt_path", ckpt, "--trainer.default_root_dir", str(tmp_path),
              "--trainer.logger", "false", "--trainer.callbacks", "null", "--trainer.val_check_interval", "null",
              "--lora_export.dirpath", str(tmp_path / "lora")]
    with monkeypatch.context() as patch:
        patch.setattr(module_lib, "build_policy", lambda *a, **k: pytest.fail("built a model"))
        with pytest.raises(SystemExit):
            cli_main(["fit", *common, "--model.policy.lora_rank", "8", "--model.jagg.jagg_frac", "0.25"])
    err = capsys.readouterr().err
    assert "model.policy.lora_rank: checkpoint 4, given 8" in err and "jagg_frac" not in err.split("depends on")[1]

    cli = cli_main(["fit", *common, "--trainer.max_steps", "3", "--model.jagg.jagg_frac", "0.25",
                    "--model.grpo.clip_range", "0.001"])
    assert cli.model.jagg.jagg_frac == 0.25 and cli.model.grpo.clip_range == 0.001
    assert cli.trainer.global_step == 3  # resumed at 2
    assert "with overrides: model.grpo.clip_range=0.001, model.jagg.jagg_frac=0.25" in capsys.readouterr().err


def test_validate_and_predict_with_the_trained_adapter(cli_run, tmp_path):
    root, config, _ = cli_run
    ckpt = str(root / "ckpt" / "last.ckpt")
    common = ["--config", str(config), "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false",
              "--trainer.callbacks", "null"]
    trained = cli_main(["validate", *common, "--ckpt_path", ckpt]).trainer.callback_metrics["val/reward_mean"]
    base = cli_main(["validate", *common]).trainer.callback_metrics["val/reward_mean"]
    assert float(trained) != float(base)  # the checkpoint's adapter is what was evaluated
    guided = cli_main(["validate", *common, "--ckpt_path", ckpt, "--model.evaluation.guidance_scale", "3.0"])
    assert float(guided.trainer.callback_metrics["val/reward_mean"]) != float(trained)  # guidance reaches sampling
    assert guided.model.policy.config.guidance_scale == 1.0  # and is the evaluation's only
    cli = cli_main(["predict", *common, "--ckpt_path", ckpt, "--model.evaluation.samples_per_prompt", "2"])
    files = sorted((tmp_path / "predictions").glob("*.png"))
    # the prompt in each name (val_prompts: predict falls back to them), unique by prompt index and sample
    held_out = ["a-held-out-cat", "a-held-out-dog", "a-boat"]
    assert [f.name for f in files] == [f"p{i:05d}_s{s:02d}_{held_out[i]}.png" for i in range(3) for s in range(2)]
    with Image.open(files[0]) as img:
        assert img.size == cli.model.policy.resolution[::-1]  # (width, height)


@pytest.mark.parametrize("precision,dtype", [("32-true", "float32"), ("bf16-mixed", "float32"),
                                             ("bf16-true", "bfloat16"), ("16-true", "float16"),
                                             ("64-true", "float64")])
def test_lora_and_optimizer_state_stay_full_precision(precision, dtype, rng_seed):
    seed = rng_seed % 10_000
    module = JAGGModule(tiny_policy_config(dtype=dtype), SamplingConfig(num_steps=4, group_size=2),
                        GRPOConfig(train_batch_size=4), JAGGConfig(window_size=2), seed=seed)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", precision=precision, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(prompts=PROMPTS[:2], batch_size=2))
    full = torch.float64 if dtype == "float64" else torch.float32
    lora = module.policy.lora_parameters()
    assert lora and all(p.dtype == full for p in lora)
    frozen = [p for p in module.policy.transformer.parameters() if not p.requires_grad]
    assert all(p.dtype == getattr(torch, dtype) for p in frozen)
    state = [t for s in trainer.optimizers[0].state.values() for t in s.values() if t.is_floating_point() and t.ndim]
    assert state and all(t.dtype == full for t in state)
    assert torch.isfinite(torch.stack([p.detach().double().abs().sum() for p in lora])).all()


def test_unsupported_precision_is_refused_in_the_python_api_too():
    module = JAGGModule(tiny_policy_config(), SamplingConfig(num_steps=4, group_size=2), jagg=JAGGConfig(window_size=2))
    trainer = L.Trainer(max_steps=1, accelerator="cpu", precision="16-true", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"model\.policy\.dtype must be 'float16' with trainer\.precision 16-true"):
        trainer.fit(module, PromptDataModule(prompts=PROMPTS[:2]))


class FailsOnSecondCall(Reward):
    name = "flaky_scorer"

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.freeze()

    def score(self, images, prompts):
        self.calls += 1
        if self.calls > 1:
            raise OSError("scorer server went away")
        return images.mean((1, 2, 3))


def test_failing_reward_is_named_and_a_loader_without_prompts_is_explained(rng_seed):
    """(A loader of plain prompt strings is accepted: tests/training/test_drop_in.py.)"""
    seed = rng_seed % 10_000
    reward = WeightedReward([JpegCompressibility(), FailsOnSecondCall()])
    module = JAGGModule(tiny_policy_config(), SamplingConfig(num_steps=4, group_size=2, rollout_batch_size=2),
                        GRPOConfig(train_batch_size=4), JAGGConfig(window_size=2), reward=reward, seed=seed)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match=r"reward flaky_scorer \(FailsOnSecondCall\) failed: OSError: scorer server"):
        trainer.fit(module, PromptDataModule(prompts=PROMPTS[:2], batch_size=2))
    with pytest.raises(TypeError, match=r"batches must be prompt strings or dicts \{'prompt': \[str\], 'index': "
                                        r"\[int\]\}.*got Tensor"):
        L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                  enable_model_summary=False).fit(module, DataLoader([3, 4], batch_size=2))


@pytest.mark.parametrize("build,field", [
    (lambda: PolicyConfig(lora_rank=2.5), "policy.lora_rank"),
    (lambda: PolicyConfig(resolution=-32), "policy.resolution"),
    (lambda: PolicyConfig(resolution=[480, 832, 3]), "policy.resolution"),
    (lambda: PolicyConfig(resolution=[480.0, 832]), "policy.resolution"),
    (lambda: SD3Policy(tiny_policy_config(num_frames=9)), "policy.num_frames: the sd3 family makes images"),
    (lambda: PolicyConfig(lora_targets="attn.to_q"), "policy.lora_targets"),
    (lambda: SamplingConfig(num_steps=4.0), "sampling.num_steps"),
    (lambda: PromptDataModule(prompts="a cat"), "data.prompts"),
    (lambda: PromptDataModule(prompts=["", "  "]), r"data.prompts\[0\]"),
    (lambda: PromptDataModule(val_prompts=["ok", 3]), r"data.val_prompts\[1\]"),
])
def test_bad_values_in_the_python_api_name_the_field(build, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.") + ("" if ":" in field else " must")):
        build()


@pytest.mark.parametrize("resolution,size", [(None, (32, 32)), (48, (48, 48)), ([48, 32], (48, 32)),
                                             ([32, 64], (32, 64))])
def test_resolution_is_height_then_width(resolution, size):
    """An integer is a square, a pair is [height, width] as diffusers' height= / width=; null the native size."""
    assert image_size(resolution, 32) == size
    assert image_size(resolution, (32, 32)) == size
    assert PolicyConfig(resolution=resolution).resolution == resolution  # kept as written (checkpoints, printed config)


DDP_VALIDATE = textwrap.dedent('''
    import json, os, sys
    sys.path[:0] = sys.argv[3].split(os.pathsep)
    import lightning as L
    from test_cli_safety import eval_module, eval_data
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    module = eval_module(int(sys.argv[2]))
    module.configure_model()
    seen, score = [], module.sampler.score
    def recording_score(reward, images, prompts, latents=None):  # what this process scored, sample by sample
        total, components = score(reward, images, prompts, latents)
        seen.extend(zip(prompts, total.double().tolist()))
        return total, components
    module.sampler.score = recording_score
    metrics = trainer.validate(module, eval_data(), verbose=False)[0]
    open(f"{sys.argv[1]}/scores_{trainer.global_rank}.json", "w").write(json.dumps(seen))
    if trainer.is_global_zero:
        open(sys.argv[1] + "/metrics.json", "w").write(json.dumps(metrics))
''')


def eval_module(seed):
    from jagg_lightning import EvalConfig

    module = JAGGModule(tiny_policy_config(), SamplingConfig(num_steps=4, group_size=2),
                        jagg=JAGGConfig(window_size=2), evaluation=EvalConfig(num_steps=2, samples_per_prompt=2), seed=seed)
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


def eval_data():
    return PromptDataModule(val_prompts=["a cat", "a dog", "a tree"], eval_batch_size=2)  # 3 prompts: 2 + 1 per rank


@pytest.mark.distributed
@pytest.mark.subprocess
@pytest.mark.slow
def test_validation_mean_is_over_every_sample_of_every_process(tmp_path, rng_seed):
    seed = rng_seed % 10_000
    script = tmp_path / "ddp_validate.py"
    script.write_text(DDP_VALIDATE)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(seed), search_path()],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = json.loads((tmp_path / "metrics.json").read_text())
    module = eval_module(seed)  # the same 6 images by hand, scored once each
    images = module.generate(["a cat", "a dog", "a tree"], [0, 1, 2])
    expected = module.reward_fn(images, [p for p in ["a cat", "a dog", "a tree"] for _ in range(2)]).double().mean()
    # Aggregation, exactly: the logged mean is the mean over the samples every process scored (4 + 2).
    ranks = [json.loads((tmp_path / f"scores_{r}.json").read_text()) for r in (0, 1)]
    assert sorted(len(r) for r in ranks) == [2, 4]
    seen = [x for r in ranks for x in r]
    assert sorted(p for p, _ in seen) == sorted(p for p in ["a cat", "a dog", "a tree"] for _ in range(2))
    mean = sum(v for _, v in seen) / len(seen)
    assert ddp["val/reward_mean"] == pytest.approx(mean, rel=1e-6)
    assert ddp["val/reward/jpeg_compressibility"] == pytest.approx(mean, rel=1e-6)
    # Generation: the same images as one process makes. JPEG sizes are whole bytes, and an ulp of difference
    # in a pixel (another batch layout) can move one image by a byte: 1e-3 kB over 6 images.
    assert ddp["val/reward_mean"] == pytest.approx(float(expected), abs=2e-3)


class Parsed(Exception):
    """Raised instead of building anything: the resume's overrides are decided by then."""


@pytest.mark.parametrize("args,key,value", [
    (["--model.sampling.noise_level", "0.55"], "sampling.noise_level", 0.55),
    (["--model.grpo.clip_range", "0.003"], "grpo.clip_range", 0.003),
    (["--model.jagg.jagg_frac", "0.25"], "jagg.jagg_frac", 0.25),
    (["--model.memory.anchors", "split"], "memory.anchors", "split"),
    (["--model.evaluation.grid_prompts", "1"], "evaluation.grid_prompts", 1),
    (["--model.reward", "jpeg_incompressibility"], "reward", "jpeg_incompressibility"),
    (["--model.reward_workers", "3"], "reward_workers", 3),
    (["--model.policy.guidance_scale", "2.5"], "policy.guidance_scale", 2.5),
    (["--model.policy.lora_alpha", "64"], None, "model.policy.lora_alpha: checkpoint 8"),  # restates the default
    (["--model.policy.lora_targets", "[to_q]"], None, "model.policy.lora_targets: checkpoint"),
    (["--model.ema_decay", "0.5"], None, "model.ema_decay: checkpoint None, given 0.5"),
    (["--model.seed", "3"], None, "model.seed: checkpoint"),  # it seeds the LoRA init (the policy stream) too
    (["--model.optimizer", "torch.optim.SGD", "--model.optimizer.lr", "0.1"], None, "model.optimizer"),
    (["--model.lr_scheduler", "torch.optim.lr_scheduler.ConstantLR"], None, "model.lr_scheduler"),
])
def test_every_resume_override_is_applied_or_refused_by_name(cli_run, args, key, value, capsys, monkeypatch):
    """One override per section of the model on resume from the run's checkpoint: the ones the checkpoint does not
    depend on reach the module's config (and are announced); the others stop with one line naming the field."""
    from jagg_lightning.cli import JAGGCLI

    root, config, _ = cli_run
    seen = {}

    def parsed(self):
        seen.update(self.config["fit"]["model"].items(branches=False))
        raise Parsed

    monkeypatch.setattr(JAGGCLI, "instantiate_classes", parsed)  # the overrides are applied just before it
    common = ["fit", "--config", str(config), "--ckpt_path", str(root / "ckpt" / "last.ckpt")]
    if key is None:
        with pytest.raises(SystemExit) as info:
            cli_main([*common, *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert info.value.code == 2 and len(err) == 1 and err[0].startswith("jagg: error: --ckpt_path"), err
        assert value in err[0], err[0]
        return
    with pytest.raises(Parsed):
        cli_main([*common, *args])
    assert seen.get(key) == value, {k: v for k, v in seen.items() if k.startswith(key.split(".")[0])}
    assert f"with overrides: model.{key}" in capsys.readouterr().err
