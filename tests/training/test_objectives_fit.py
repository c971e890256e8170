"""The forward-process objectives through the Lightning Trainer (``model.objective``): a DiffusionNFT run with a
lagging theta_old resumes from a mid-run checkpoint bit for bit (theta_old is in the checkpoint), and so do DGPO (its
theta_old, its rollout under theta_old) and Flow-DPPO; the first update's
theta_old convention (theta_old = theta: no forward of its own) and its lag afterwards, counted in the logged passes;
JAGG over the levels makes one backward per micro-batch where the exact update makes K, and RoutingStats plots no
SDE windows for it."""

import random

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, ObjectiveConfig, PromptDataModule, SamplingConfig
from jagg_lightning.callbacks import RoutingStats

from helpers import tiny_policy_config

PROMPTS = ["a cat", "a dog", "a tree", "a boat"]
LEVELS = 3


class Passes(Callback):
    """(no-grad forwards, backwards) logged by every training step."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        self.rows.append((float(m["train/passes/nograd_forward"]), float(m["train/passes/backward"]),
                          float(m["train/reward_mean"]), float(m["train/routed_frac"])))


def run(seed, root, steps, objective, checkpoint=None, ckpt_path=None, callbacks=()):
    module = JAGGModule(tiny_policy_config(resolution=64), SamplingConfig(num_steps=4, group_size=2, rollout_batch_size=4),
                        GRPOConfig(train_batch_size=2), JAGGConfig(window_size=2),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=0.05), seed=seed,
                        objective=ObjectiveConfig(**objective))
    passes = Passes()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=checkpoint is not None, default_root_dir=root,
                        callbacks=[passes, *callbacks] + ([checkpoint] if checkpoint else []))
    trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=2, seed=seed), ckpt_path=ckpt_path)
    return passes.rows, [p.detach().clone() for p in module.policy.lora_parameters()], module


# decay type 2 keeps theta_old = theta for 75 steps; type 1 lags from the first step on (d = 0.001 s)
NFT = dict(name="nft", num_levels=LEVELS, nft_decay_type=1)


@pytest.mark.slow
def test_nft_resumes_exactly_with_its_theta_old(tmp_path):
    """3 steps straight, or 2 then a resume from the step-2 checkpoint: the same rewards, passes and weights bit for
    bit -- theta_old (which differs from theta after step 1) comes back from the checkpoint."""
    seed = random.randrange(10_000)
    full_rows, full_weights, full = run(seed, tmp_path / "full", 3, NFT)
    ckpt = tmp_path / "ckpt"
    first_rows, _, first = run(seed, tmp_path / "first", 2, NFT,
                               ModelCheckpoint(dirpath=ckpt, every_n_train_steps=2, save_top_k=-1))
    [path] = ckpt.glob("*.ckpt")
    saved = torch.load(path, weights_only=True)["jagg"]["objective"]["old_policy"]
    assert len(saved) == len(full_weights) and any(not torch.equal(s, w) for s, w in zip(saved, full_weights))
    second_rows, second_weights, _ = run(seed, tmp_path / "second", 3, NFT, ckpt_path=str(path))
    assert first_rows + second_rows == full_rows
    for a, b in zip(second_weights, full_weights):
        assert torch.equal(a, b)
    # the theta_old conventions, counted: step 0 samples and trains with theta_old = theta (no forward of its own,
    # 2 micro-batches x 3 levels = 6 backwards); from step 1 theta_old lags, one no-grad forward per level
    assert full_rows[0][:2] == (0.0, 2 * LEVELS)
    assert [r[:2] for r in full_rows[1:]] == [(2 * LEVELS, 2 * LEVELS)] * 2


def test_jagg_over_levels_through_the_trainer(tmp_path):
    """AWM with one eps per sample: exact makes K backwards per micro-batch, ``objective.jagg`` one (K - 2 no-grad
    forwards for the interior levels); both train. ``train/routed_frac`` is the share of the LEVEL windows routed (0
    exact, 1 with jagg), not of the GRPO plan's SDE windows, which this objective does not train."""
    counts = {}
    for jagg in (False, True):
        rows, weights, module = run(0, tmp_path / str(jagg), 1,
                                    dict(name="awm", num_levels=LEVELS, shared_noise=True, jagg=jagg),
                                    callbacks=[RoutingStats()])
        # no SDE windows routed: no routing.png (a per-timestep plot of windows it never had) for the summary to list
        assert not list((tmp_path / str(jagg)).rglob("*.png"))
        counts[jagg] = rows[0][:2] + rows[0][3:]
        assert module.exact_backwards == 2 * LEVELS
        assert [w.steps for w in module.windows] == [tuple(range(LEVELS))]
    assert counts == {False: (0.0, 2 * LEVELS, 0.0), True: (2 * (LEVELS - 2), 2.0, 1.0)}


NEW = {  # DGPO: theta_old lags from step 1 (d = 0.001 n) and samples the rollout from step 2; Flow-DPPO: no state
    "dgpo": dict(name="dgpo", num_levels=LEVELS, dgpo_trunc_steps=3, dgpo_old_rollout_after=1),
    "flow_dppo": dict(name="flow_dppo", dppo_threshold=0.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NEW))
def test_dgpo_and_flow_dppo_resume_exactly(name, tmp_path):
    """3 steps straight, or 2 then a resume from the step-2 checkpoint: the same rewards, passes and weights bit for
    bit (DGPO's theta_old, which differs from theta after step 1, comes back from the checkpoint)."""
    seed = random.randrange(10_000)
    full_rows, full_weights, _ = run(seed, tmp_path / "full", 3, NEW[name])
    ckpt = tmp_path / "ckpt"
    first_rows, _, _ = run(seed, tmp_path / "first", 2, NEW[name],
                           ModelCheckpoint(dirpath=ckpt, every_n_train_steps=2, save_top_k=-1))
    [path] = ckpt.glob("*.ckpt")
    saved = torch.load(path, weights_only=True)["jagg"]["objective"]
    if name == "dgpo":
        assert any(not torch.equal(s, w) for s, w in zip(saved["old_policy"], full_weights))
    second_rows, second_weights, _ = run(seed, tmp_path / "second", 3, NEW[name], ckpt_path=str(path))
    assert first_rows + second_rows == full_rows
    assert any(not torch.equal(a, b) for a, b in zip(full_weights, run(seed, tmp_path / "one", 1, NEW[name])[1]))
    for a, b in zip(second_weights, full_weights):
        assert torch.equal(a, b)
