"""Two CPU processes train an objective exactly like one process on the union of their prompts: under Lightning's DDP
(DiffusionNFT with a lagging theta_old and JAGG over its noise levels; DGPO with a lagging theta_old sampling the
rollout, its groups and group noise; Flow-DPPO through routed JAGG windows over two inner epochs, where its mask acts)
and under FSDP2 (NFT and
AWM, each also resumed under FSDP2 from a mid-run checkpoint, theta_old included, to the uninterrupted weights). The
levels are drawn per update from (seed, step), each sample's noise from its own generator, the advantages' std
all-reduced."""

import textwrap

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, ObjectiveConfig, SamplingConfig
from jagg_lightning.data import PromptDataModule

from helpers import float64_reward, randomize_lora_b, rel_error, sgd, tiny_policy_config
from launch import lightning_ddp_weights, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.slow]

NAMES = ("nft", "awm")  # NFT with a lagging theta_old and JAGG over its levels; AWM exact
PROMPTS = ["a red cat", "a blue dog", "a green tree", "a yellow sun"]


def make(seed, name="nft"):
    module = JAGGModule(tiny_policy_config(dtype="float64", resolution=64),
                        SamplingConfig(num_steps=4, group_size=2, rollout_batch_size=2),
                        GRPOConfig(train_batch_size=2), JAGGConfig(window_size=2), optimizer=sgd,
                        reward=float64_reward("float64"), seed=seed,
                        objective=ObjectiveConfig(name=name, num_levels=3, shared_noise=True, jagg=name == "nft"))
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


DDP_RUN = textwrap.dedent('''
    import sys
    import lightning as L
    from safetensors.torch import save_file
    from jagg_lightning.data import PromptDataModule
    from test_ddp_objectives import PROMPTS, make, make_new
    module = make(int(sys.argv[2])) if NAME == "nft" else make_new(int(sys.argv[2]), NAME)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=1, shuffle=False))
    weights = {n: p.detach().contiguous() for n, p in module.named_parameters() if p.requires_grad}
    save_file(weights, f"{sys.argv[1]}/rank{trainer.global_rank}.safetensors")
    from jagg_lightning.distributed.collectives import end_process_group
    end_process_group()
''')


def make_new(seed, name):
    """DGPO (3 of the 4 schedule levels, theta_old sampling from step 1) or Flow-DPPO (W = 3 routed, threshold 0: the
    mask drops every step moving away), each with two inner epochs (the second update reads theta != theta_old)."""
    objective = (ObjectiveConfig(name="dgpo", num_levels=3, dgpo_trunc_steps=3, dgpo_old_rollout_after=0)
                 if name == "dgpo" else ObjectiveConfig(name="flow_dppo", dppo_threshold=0.0))
    module = JAGGModule(tiny_policy_config(dtype="float64", resolution=64),
                        SamplingConfig(num_steps=4, group_size=2, rollout_batch_size=2),
                        GRPOConfig(train_batch_size=2, inner_epochs=2),
                        JAGGConfig(window_size=3, jagg_frac=1.0) if name == "flow_dppo" else JAGGConfig(window_size=2),
                        optimizer=sgd, reward=float64_reward("float64"), seed=seed, objective=objective)
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


@pytest.mark.parametrize("name", ["nft", "dgpo", "flow_dppo"])
def test_ddp_objective_matches_single_process(name, tmp_path, rng_seed):
    seed = rng_seed % 10_000
    build = make if name == "nft" else (lambda s: make_new(s, name))
    script = f"NAME = {name!r}\n" + DDP_RUN
    rank0, rank1 = lightning_ddp_weights(tmp_path, script, seed, timeout=900)
    single = build(seed)
    L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(single, PromptDataModule(prompts=PROMPTS, batch_size=2, shuffle=False))
    initial = build(seed)
    moved = 0
    for name, p in single.named_parameters():
        if p.requires_grad:
            assert torch.equal(rank0[name], rank1[name]), name  # gradients were synchronised
            torch.testing.assert_close(rank0[name], p.detach(), rtol=1e-9, atol=1e-12)
            moved += int(not torch.equal(p.detach(), initial.get_parameter(name).detach()))
    assert moved > 0


FSDP2_RUN = textwrap.dedent('''
    import sys
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from jagg_lightning.callbacks.checkpoint import AtomicCheckpointIO
    from jagg_lightning.data import PromptDataModule
    from jagg_lightning.strategies import FSDP2Strategy
    from test_ddp_objectives import PROMPTS, make, NAMES

    out, seed = sys.argv[1], int(sys.argv[2])

    def fit(name, ckpt_path=None):
        module = make(seed, name)
        saving = ckpt_path is None
        trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=2, strategy=FSDP2Strategy(process_group_backend="gloo"),
                            plugins=[AtomicCheckpointIO()], logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=saving, default_root_dir=out,
                            callbacks=[ModelCheckpoint(dirpath=f"{out}/{name}_ckpt", filename="{step}",
                                                       every_n_train_steps=1, save_top_k=-1)] if saving else [])
        trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=1, shuffle=False), ckpt_path=ckpt_path)
        assert isinstance(module.policy.lora_parameters()[0], DTensor)  # really sharded
        weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
                   for n, p in module.named_parameters() if p.requires_grad}
        if trainer.global_rank == 0:
            save_file(weights, f"{out}/{name}_{'final' if saving else 'resumed'}.safetensors")

    for name in NAMES:
        fit(name)
        fit(name, ckpt_path=f"{out}/{name}_ckpt/step=1.ckpt")
    from jagg_lightning.distributed.collectives import end_process_group
    end_process_group()
''')


def test_fsdp2_objectives_match_single_process_and_resume(tmp_path, rng_seed):
    seed = rng_seed % 10_000
    script = tmp_path / "fsdp2_run.py"
    script.write_text(FSDP2_RUN)
    run_ranks(script, str(tmp_path), str(seed), timeout=300)
    for name in NAMES:
        final = load_file(tmp_path / f"{name}_final.safetensors")
        resumed = load_file(tmp_path / f"{name}_resumed.safetensors")
        initial, single = make(seed, name), make(seed, name)
        L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(single, PromptDataModule(prompts=PROMPTS, batch_size=2,
                                                                            shuffle=False))
        names = sorted(final)
        start = [initial.get_parameter(n).detach() for n in names]
        update = [single.get_parameter(n).detach() - s for n, s in zip(names, start)]
        assert sum(float(u.abs().sum()) for u in update) > 0, name
        # float64 up to the float32 timestep embedding over different batch layouts (see test_fsdp2.py); theta_old's
        # swaps reshard the root unit, whose gathered weights FSDP2 keeps after a forward (sharding.values_swapped)
        assert rel_error([final[n] - s for n, s in zip(names, start)], update) < 1e-6, name
        # the same layout resumed from step 1 (theta_old and the optimizer state through the sharded checkpoint)
        assert rel_error([resumed[n] - s for n, s in zip(names, start)],
                         [final[n] - s for n, s in zip(names, start)]) < 1e-12, name
