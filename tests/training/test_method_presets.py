"""The method presets do what their methods' released code does (issue 55): GRPO-Guard's two optimizer steps per
rollout (where the importance ratio leaves 1 and RatioNorm's clip acts), AWM's stratified noise levels and
clamp(A, -c, c) / c advantage, Flash-GRPO's noise sigma_t = sigmas[1] t behind its rectification weights, and the
NFT preset's level draw as its comment says. Sources: each preset's header."""

import math
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, ObjectiveConfig, PromptDataModule, SamplingConfig
from jagg_lightning.method.grpo import rectification_weights
from jagg_lightning.method.sde import flow_match_sigmas
from jagg_lightning.objectives import MatchingPoint, build_objective
from jagg_lightning.objectives.forward_process import noise_levels

from helpers import tiny_policy_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def preset(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def updates_per_rollout(config: dict) -> float:
    """Optimizer steps one rollout makes: its micro-batches over those per update (null: all of them)."""
    model, grpo = config["model"], config["model"]["grpo"]
    micro_batches = config["data"]["batch_size"] * model["sampling"]["group_size"] / grpo["train_batch_size"]
    return micro_batches / (grpo.get("micro_batches_per_update") or micro_batches) * grpo.get("inner_epochs", 1)


def test_grpo_guard_preset_is_the_released_config():
    """flow_grpo config/grpo_guard.py pickscore_hps_sd3_ratio_norm: two optimizer steps per rollout, clip 4e-6,
    no KL, per-prompt std, lr 1e-4, 24 images per prompt, PickScore."""
    config = preset("sd35_medium_grpo_guard.yaml")
    model = config["model"]
    grpo = model["grpo"]
    assert updates_per_rollout(config) == 2
    assert (grpo["clip_range"], grpo["kl_beta"], grpo["adv_std"], grpo["ratio_norm"]) == (4e-6, 0.0, "group", True)
    assert model["optimizer"]["init_args"]["lr"] == 1e-4 and model["sampling"]["group_size"] == 24
    assert model["reward"]["class_path"].endswith("PickScoreReward")


class Ratios(Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        self.rows.append((float(m["train/ratio_mean"]), float(m["train/clip_frac"])))


@pytest.mark.slow
def test_on_the_grpo_guard_presets_settings_the_ratio_leaves_one_and_the_clip_acts(tmp_path, rng_seed):
    """The preset's grpo section and learning rate on the tiny SD3, its two optimizer steps per rollout kept
    (micro-batches scaled to the tiny rollout): the second update's RatioNorm ratio is not 1 and its clip at
    4e-6 acts (measured: 4 % of the samples' steps clipped). With one step per rollout (the preset before) the
    ratio stays at 1 (equal rollout and train batch sizes: Flow-GRPO's first-update rule) and nothing is clipped."""
    config = preset("sd35_medium_grpo_guard.yaml")["model"]
    lr = config["optimizer"]["init_args"]["lr"]
    rows = {}
    for updates in (2, 1):
        grpo = dict(config["grpo"], train_batch_size=2, micro_batches_per_update=4 // updates)  # 4 micro-batches
        module = JAGGModule(tiny_policy_config(resolution=64), SamplingConfig(num_steps=4, group_size=4,
                                                                              rollout_batch_size=2),
                            GRPOConfig(**grpo), JAGGConfig(window_size=2),
                            optimizer=lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=1e-4), seed=rng_seed)
        ratios = Ratios()
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                            callbacks=[ratios])
        trainer.fit(module, PromptDataModule(prompts=["a cat", "a dog"], batch_size=2, seed=rng_seed))
        rows[updates] = ratios.rows[0]
    # a sample is clipped only where its ratio is off 1 by more than 4e-6: the second update's ratio left 1 (the
    # logged ratio mean is a float32 mean of values within ~1e-5 of 1, so it reads 1.0 itself)
    clip_frac = rows[2][1]
    assert clip_frac > 0 and abs(rows[2][0] - 1) < 1e-3, rows
    assert abs(rows[1][0] - 1) < 1e-6 and rows[1][1] == 0, rows


# ---------------------------------------------------------------------- AWM
def test_stratified_levels_draw_one_schedule_time_per_stratum(rng_seed):
    """6 strata over the indices 1..11 of a 14-step schedule: {1,2} {3,4} {5,6} {7,8} {9,10} {11}, one index
    each, uniformly; never t = 1 (index 0), which 'schedule' levels include in 6 of 14 draws."""
    schedule = flow_match_sigmas(14).double()
    strata = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11]]
    gen = torch.Generator().manual_seed(rng_seed)
    counts = torch.zeros(15)
    for _ in range(400):
        t = noise_levels("stratified", 6, schedule, 1.0, gen, (1, 11))
        index = [int((schedule - ti).abs().argmin()) for ti in t]
        assert [i in stratum for i, stratum in zip(index, strata)] == [True] * 6 and 0 not in index
        counts[index] += 1
    assert counts[0] == 0 and counts[12:].sum() == 0 and counts[11] == 400
    for first, second in strata[:-1]:  # each of a stratum's two indices about half the time (binomial, 6 sd)
        assert abs(counts[first] - 200) < 6 * 10, counts
    with_t1 = sum(bool((noise_levels("schedule", 6, schedule, 1.0, gen) == 1.0).any()) for _ in range(400))
    assert 100 < with_t1 < 240  # 6/14 = 43 % of 'schedule' draws train t = 1
    with pytest.raises(ValueError, match=r"objective\.num_levels must be <= 3, the indices in objective\.level_range"):
        ObjectiveConfig(name="awm", num_levels=6, levels="stratified", level_range=[1, 3]).check_sections(14)
    with pytest.raises(ValueError, match=r"objective\.level_range must be indices <= sampling\.num_steps - 1"):
        ObjectiveConfig(name="awm", num_levels=6, levels="stratified", level_range=[1, 14]).check_sections(14)


def test_awm_scaled_advantage_is_the_codes_clamp_over_c(rng_seed):
    """awm_advantage 'scaled': the policy term is clamp(A, -c, c) / c x w(t) x mse (a float64 transcription);
    'clipped' is c times it."""
    gen = torch.Generator().manual_seed(rng_seed)
    x0, eps, v = (torch.randn(4, 2, 3, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    t = torch.tensor(0.6, dtype=torch.float64)
    raw = 3 * torch.randn(4, generator=gen, dtype=torch.float64)
    clip = 5.0
    advantages = raw.clamp(-clip, clip)  # as the grpo section hands them over
    point = MatchingPoint(x0, eps, t, (1 - t) * x0 + t * eps, advantages)
    sampling, grpo, jagg = SamplingConfig(num_steps=10), GRPOConfig(adv_clip=clip), JAGGConfig(window_size=2)
    losses = {}
    for kind in ("scaled", "clipped"):
        objective = build_objective(ObjectiveConfig(name="awm", awm_advantage=kind), sampling, grpo, jagg)
        losses[kind] = objective.point_loss(v, point)[0]
    mse = ((v - (eps - x0)) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(losses["scaled"], torch.clamp(raw, -5, 5) / 5 * mse, rtol=1e-13, atol=0)
    torch.testing.assert_close(losses["clipped"], clip * losses["scaled"], rtol=1e-13, atol=0)
    with pytest.raises(ValueError, match=r"objective\.awm_advantage must be 'clipped' or 'scaled', got 'unit'"):
        ObjectiveConfig(name="awm", awm_advantage="unit")


def test_awm_preset_uses_the_codes_levels_and_advantage():
    objective = preset("sd35_medium_awm.yaml")["model"]["objective"]
    num_steps = preset("sd35_medium_awm.yaml")["model"]["sampling"]["num_steps"]
    assert (objective["levels"], objective["level_range"], objective["num_levels"], num_steps) == \
        ("stratified", [1, 11], 6, 14)
    assert objective["awm_advantage"] == "scaled"
    ObjectiveConfig(**objective).check_sections(num_steps)


# ---------------------------------------------------------------------- Flash-GRPO, NFT
def test_flash_preset_uses_the_authors_noise_and_so_their_rectification_weights():
    """The authors' c(t) with std_dev_t = sigmas[1] t (a float64 transcription over the 20-step SD3 grid's first
    10 steps) against the engine's weights on the preset's step kind and noise level: equal, 1.36 -> 0.66."""
    sampling = preset("sd35_medium_flash_grpo.yaml")["model"]["sampling"]
    times = flow_match_sigmas(sampling["num_steps"]).double().tolist()
    assert sampling["step_kind"] == "sde_linear" and math.isclose(sampling["noise_level"], times[1], rel_tol=1e-7)

    def authors_c(k):
        t, dt = times[k], times[k + 1] - times[k]
        std_dev_t = times[1] * t
        return math.sqrt(-dt) / std_dev_t + std_dev_t * math.sqrt(-dt) * (1 - t) / (2 * t)

    steps = list(range(*sampling["sde_window_range"]))
    inverse = [1 / authors_c(k) for k in steps]
    expected = [w / (sum(inverse) / len(inverse)) for w in inverse]
    got = rectification_weights(times, steps, steps, sampling["step_kind"], sampling["noise_level"])
    assert max(abs(got[k] - e) / e for k, e in zip(steps, expected)) < 1e-6
    assert round(got[0], 2) == 1.36 and round(got[9], 2) == 0.66
    flow_grpo = rectification_weights(times, steps, steps, "sde", 0.7)  # what the preset trained with before
    assert round(flow_grpo[0], 2) == 2.55 and round(flow_grpo[9], 2) == 0.34


def test_nft_presets_comment_says_how_its_levels_are_drawn():
    """The levels are drawn per update and shared by its samples: the comment says so, not 'per sample'."""
    line = next(l for l in (CONFIGS / "sd35_medium_nft.yaml").read_text().splitlines() if "levels: schedule" in l)
    assert "per sample" not in line and "per update" in line
