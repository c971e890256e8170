"""LoRA-only checkpoints, exact resume, crash-safe saves and the two export formats."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from jagg_lightning.callbacks import AtomicCheckpointIO, LoRAExport, export_lora
from jagg_lightning.data import PromptDataModule
from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.policies.sd3 import build_tiny_sd3_pipeline

from helpers import randomize_lora_b, tiny_policy_config
from launch import search_path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [f"prompt number {i}" for i in range(8)]


def module_for_resume(seed):
    module = JAGGModule(
        tiny_policy_config(),
        SamplingConfig(num_steps=6, group_size=2),
        GRPOConfig(train_batch_size=2, inner_epochs=1),
        JAGGConfig(window_size=3, jagg_frac=0.5),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9),
        ema_decay=0.8,
        seed=seed,
    )
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


def trainer(root, steps, callbacks=()):
    return L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=root, plugins=[AtomicCheckpointIO()],
                     callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_last=True), *callbacks])


def lora_of(module):
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def test_resume_is_exact_and_checkpoint_holds_only_lora(tmp_path, rng_seed):
    seed = rng_seed % 10_000
    data = lambda: PromptDataModule(prompts=PROMPTS, batch_size=2, seed=seed)  # noqa: E731
    straight = module_for_resume(seed)
    trainer(tmp_path / "a", 4).fit(straight, data())

    first = module_for_resume(seed)
    trainer(tmp_path / "b", 2).fit(first, data())
    ckpt_path = tmp_path / "b" / "last.ckpt"
    ckpt = torch.load(ckpt_path, weights_only=True)
    assert set(ckpt["state_dict"]) == set(lora_of(first)) and len(ckpt["state_dict"]) > 0
    assert ckpt["global_step"] == 2 and ckpt["optimizer_states"] and ckpt["lr_schedulers"]
    assert set(ckpt["jagg"]["ema"]) == set(lora_of(first))

    resumed = module_for_resume(seed)  # fresh frozen weights (same seed), LoRA from the checkpoint
    trainer(tmp_path / "b", 4).fit(resumed, data(), ckpt_path=str(ckpt_path))
    a, b = lora_of(straight), lora_of(resumed)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for name, shadow in straight.ema.shadow.items():
        assert torch.equal(shadow, resumed.ema.shadow[name])
    # and training really moved the weights between step 2 and step 4
    assert any(not torch.equal(a[n], ckpt["state_dict"][n]) for n in a)


KILLED_SAVE = textwrap.dedent('''
    import os, sys, time, torch
    from pathlib import Path
    sys.path[:0] = sys.argv[2].split(os.pathsep)
    import test_checkpoint_export as t
    root = Path(sys.argv[1])
    module = t.module_for_resume(0)
    real_save = torch.save
    def slow_save(obj, f, *a, **k):
        if obj.get("global_step", 0) >= 2:          # the second save: write half, then hang
            data = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f  # AtomicCheckpointIO: a file object
            data.write(b"x" * 1000); data.flush()
            (root / "hanging").write_text("1"); time.sleep(600)
        return real_save(obj, f, *a, **k)
    torch.save = slow_save
    t.trainer(root, 3).fit(module, t.PromptDataModule(prompts=t.PROMPTS, batch_size=2))
''')


@pytest.mark.subprocess
@pytest.mark.slow
def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(KILLED_SAVE)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), search_path()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 300
    while not (tmp_path / "hanging").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 1
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".ckpt" and p.stat().st_size == 1000]


def test_exported_formats_load_in_diffusers_and_peft(tmp_path, rng_seed):
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    seed = rng_seed % 10_000
    module = module_for_resume(seed)
    export = LoRAExport(str(tmp_path / "lora"))
    L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[export]).fit(module, PromptDataModule(prompts=PROMPTS[:2]))
    final = tmp_path / "lora" / "final"
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(2, *module.policy.latent_shape, generator=gen)
    timestep = torch.rand(2, generator=gen) * 1000
    pe, pooled = module.policy.encode_prompts(["a red cat", "a dog"])

    def out(transformer):
        with torch.no_grad():
            return transformer(hidden_states=z, timestep=timestep, encoder_hidden_states=pe,
                               pooled_projections=pooled, return_dict=False)[0]

    with module.inference_weights():  # EMA is on: the export holds the EMA weights
        expected = out(module.policy.transformer)
    assert not torch.allclose(expected, out(module.policy.transformer))

    pipe = build_tiny_sd3_pipeline(seed)
    base = out(pipe.transformer)
    pipe.load_lora_weights(str(final / "diffusers"))
    torch.testing.assert_close(out(pipe.transformer), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(base, expected)

    transformer = build_tiny_sd3_pipeline(seed).transformer
    config = LoraConfig.from_pretrained(str(final / "peft"))
    assert config.r == 4 and config.lora_alpha == 8
    inject_adapter_in_model(config, transformer)
    saved = load_file(str(final / "peft" / "adapter_model.safetensors"))  # PeftModel naming: base_model.model.*
    result = set_peft_model_state_dict(transformer, {k.removeprefix("base_model.model."): v for k, v in saved.items()})
    assert not result.unexpected_keys
    torch.testing.assert_close(out(transformer), expected, rtol=1e-5, atol=1e-6)


def test_diffusers_export_carries_alpha_metadata_that_sets_the_scale(tmp_path, rng_seed):
    """alpha (8) != rank (4): the metadata sets scale 2; a file without it would load with scale 1."""
    import json

    from diffusers import StableDiffusion3Pipeline
    from safetensors import safe_open

    from jagg_lightning.callbacks import lora_state_dict

    seed = rng_seed % 10_000
    module = module_for_resume(seed)
    export_lora(module.policy, tmp_path / "x")
    with safe_open(str(tmp_path / "x" / "diffusers" / "pytorch_lora_weights.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert meta["transformer.lora_alpha"] == 8 and meta["transformer.r"] == 4
    StableDiffusion3Pipeline.save_lora_weights(str(tmp_path / "bare"), transformer_lora_layers=lora_state_dict(
        module.policy.transformer))
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(1, *module.policy.latent_shape, generator=gen)
    pe, pooled = module.policy.encode_prompts(["a red cat"])

    def loaded_output(directory):
        pipe = build_tiny_sd3_pipeline(seed)
        pipe.load_lora_weights(str(directory))
        with torch.no_grad():
            return pipe.transformer(hidden_states=z, timestep=torch.tensor([500.0]), encoder_hidden_states=pe,
                                    pooled_projections=pooled, return_dict=False)[0]

    with torch.no_grad():
        expected = module.policy.velocity(z, torch.tensor([0.5]), (pe, pooled))
    torch.testing.assert_close(loaded_output(tmp_path / "x" / "diffusers"), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(loaded_output(tmp_path / "bare"), expected, rtol=1e-4, atol=1e-5)
