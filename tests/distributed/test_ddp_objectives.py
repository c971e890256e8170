"""Two CPU processes under Lightning's DDP train a forward-process objective (DiffusionNFT, with a lagging theta_old
and JAGG over its noise levels) exactly like one process on the union of their prompts: the levels are drawn per
update from (seed, step), each sample's noise from its own generator, the advantages' std all-reduced."""

import os
import subprocess
import sys
import textwrap

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, ObjectiveConfig, SamplingConfig
from jagg_lightning.data import PromptDataModule

from helpers import float64_reward, randomize_lora_b, sgd, tiny_policy_config
from launch import search_path

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

PROMPTS = ["a red cat", "a blue dog", "a green tree", "a yellow sun"]


def make(seed):
    module = JAGGModule(tiny_policy_config(dtype="float64", resolution=64),
                        SamplingConfig(num_steps=4, group_size=2, rollout_batch_size=2),
                        GRPOConfig(train_batch_size=2), JAGGConfig(window_size=2), optimizer=sgd,
                        reward=float64_reward("float64"), seed=seed,
                        objective=ObjectiveConfig(name="nft", num_levels=3, shared_noise=True, jagg=True))
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


DDP_RUN = textwrap.dedent('''
    import sys
    import lightning as L
    from safetensors.torch import save_file
    from jagg_lightning.data import PromptDataModule
    from test_ddp_objectives import PROMPTS, make
    module = make(int(sys.argv[2]))
    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=1, shuffle=False))
    weights = {n: p.detach().contiguous() for n, p in module.named_parameters() if p.requires_grad}
    save_file(weights, f"{sys.argv[1]}/rank{trainer.global_rank}.safetensors")
    from jagg_lightning.distributed.collectives import end_process_group
    end_process_group()
''')


def test_ddp_objective_matches_single_process(tmp_path, rng_seed):
    seed = rng_seed % 10_000
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_RUN)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(seed)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=900, env=dict(os.environ, PYTHONPATH=search_path()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = load_file(tmp_path / "rank0.safetensors"), load_file(tmp_path / "rank1.safetensors")
    single = make(seed)
    L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(single, PromptDataModule(prompts=PROMPTS, batch_size=2, shuffle=False))
    initial = make(seed)
    moved = 0
    for name, p in single.named_parameters():
        if p.requires_grad:
            assert torch.equal(rank0[name], rank1[name]), name  # gradients were synchronised
            torch.testing.assert_close(rank0[name], p.detach(), rtol=1e-9, atol=1e-12)
            moved += int(not torch.equal(p.detach(), initial.get_parameter(name).detach()))
    assert moved > 0
