"""Latent rewards (``Reward.scores_latents``): the rollout hands them the final latents and skips the VAE decode,
decoding only when another reward needs images; ``train/decodes`` counts what was decoded."""

import pytest
import torch
import yaml

from jagg_lightning.rewards import JpegCompressibility, MonitoredReward, WeightedReward

from in_process import jagg_in_process
from latent_rewards import LatentEnergy
from modules import PROMPTS, make_module


@pytest.fixture(scope="module")
def module():
    return make_module(20261204)


def energy64(latents: torch.Tensor) -> torch.Tensor:
    return -(latents.double() ** 2).flatten(1).mean(1)


@pytest.mark.slow
def test_latent_rewards_skip_the_decode_unless_another_needs_images(module, rng_seed):
    """One rollout scored by a latent reward beside an image reward (one decode per sample, each reward its own
    input), then the same latents scored by the latent reward alone (no decode)."""
    sampler, latent, jpeg = module.sampler, LatentEnergy(), JpegCompressibility()
    reward = MonitoredReward(WeightedReward([latent, jpeg], [1.0, 0.01]), [LatentEnergy()])
    assert reward.needs_images() and reward.needs_latents()
    before = sampler.decoded_samples
    traj, _, prompts, rewards, components = sampler.rollout_and_score(PROMPTS[:1], [0], step=rng_seed % 1000,
                                                                      reward=reward)
    final, n = traj.latents[-1], traj.latents.shape[1]
    assert sampler.decoded_samples - before == n  # one decode per sample, for the JPEG reward
    assert torch.equal(torch.cat(latent.seen), final)  # handed exactly the sampled final latents, in order
    torch.testing.assert_close(components["latent_energy"].double(), energy64(final), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(components["monitor/latent_energy"], components["latent_energy"])
    images = module.policy.decode_samples(final, prompts)
    torch.testing.assert_close(components["jpeg_compressibility"], jpeg(images, prompts))
    torch.testing.assert_close(rewards, components["latent_energy"] + 0.01 * components["jpeg_compressibility"])

    alone = LatentEnergy()
    before = sampler.decoded_samples
    total, parts = sampler.decode_and_score(alone, final, prompts)
    assert sampler.decoded_samples == before and set(parts) == {"latent_energy"}  # nothing decoded
    torch.testing.assert_close(total.double(), energy64(final), rtol=1e-6, atol=1e-7)
    poisoned = final.clone()
    poisoned[0].view(-1)[0] = float("nan")  # scored on a finite stand-in; the update skips the sample itself
    assert torch.isfinite(sampler.decode_and_score(alone, poisoned, prompts)[0]).all()


def test_latent_reward_refuses_images():
    with pytest.raises(ValueError, match="reward latent_energy: scores latents, so it must be called with latents="):
        LatentEnergy()(torch.rand(2, 3, 8, 8), ["a", "b"])
    with pytest.raises(ValueError, match="got 2 latents but 1 prompts"):
        LatentEnergy()(None, ["a"], latents=torch.randn(2, 4, 2, 2))
    with pytest.raises(ValueError, match="reward jpeg_compressibility: scores images, got NoneType"):
        WeightedReward([LatentEnergy(), JpegCompressibility()])(None, ["a"], latents=torch.randn(1, 4, 2, 2))


@pytest.mark.slow
def test_jagg_fit_with_a_latent_reward_logs_no_decodes(tmp_path, capfd, monkeypatch):
    root = tmp_path / "run"
    cfg = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False, "enable_checkpointing": False,
                    "enable_model_summary": False, "default_root_dir": str(root), "log_every_n_steps": 1,
                    "limit_val_batches": 1, "val_check_interval": 2, "num_sanity_val_steps": 0,
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root)}}},
        "model": {"policy": {"lora_rank": 4, "lora_alpha": 8, "guidance_scale": 1.0, "max_sequence_length": 4},
                  "sampling": {"num_steps": 3, "group_size": 2, "rollout_batch_size": 2},
                  "grpo": {"train_batch_size": 2}, "jagg": {"window_size": 2},
                  "evaluation": {"samples_per_prompt": 1, "num_steps": 2, "grid_prompts": 1},
                  "reward": {"class_path": "latent_rewards.LatentEnergy"}},
        "data": {"prompts": ["a cat", "a dog"], "val_prompts": ["a boat"], "batch_size": 1},
        "lora_export": {"dirpath": str(root / "lora")},
    }
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(cfg))
    proc = jagg_in_process("fit", "--config", tmp_path / "fit.yaml", cwd=tmp_path, capfd=capfd, monkeypatch=monkeypatch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import csv

    rows = list(csv.DictReader(open(root / "lightning_logs" / "version_0" / "metrics.csv")))
    decodes = [float(r["train/decodes"]) for r in rows if r.get("train/decodes")]
    assert decodes == [0.0, 0.0]
    assert [r for r in rows if r.get("val/reward_mean")], "the evaluation scored the latents too"
    assert all(float(r["train/reward_mean"]) < 0 for r in rows if r.get("train/reward_mean"))
