"""The samplers of the field on the tiny SD3 with the real Trainer: SDE windows (Flow-GRPO-Fast /
MixGRPO), CFG-free training, window subsampling (DanceGRPO's timestep_fraction), the zero-advantage
skip, and the first-update ratio warning."""

import copy
import re
import warnings

import lightning as L
import pytest
import torch

from jagg_lightning import EvalConfig, GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.data import PromptDataModule
from jagg_lightning.method.grpo import StepLossStats, group_advantages
from jagg_lightning.rewards import Reward
from jagg_lightning.training.metrics import FirstUpdateRatioCheck
from jagg_lightning.training.rollout import choose_windows, plan_rollout, sde_window_start

from helpers import (
    exact_per_step_gradient, float64_reward, nonzero_advantages, randomize_lora_b, rel_error, tiny_policy_config,
)
from modules import PROMPTS, fit


def build(seed, sampling=None, grpo=None, jagg=None, dtype="float32", optimizer=None, reward=None, evaluation=None,
          **policy):
    """``reward`` default: the tests' reward at the run's precision (continuous in float64, ``float64_reward``)."""
    module = JAGGModule(
        tiny_policy_config(dtype=dtype, **policy),
        SamplingConfig(**({"num_steps": 6, "group_size": 3, "rollout_batch_size": 3} | (sampling or {}))),
        GRPOConfig(**({"train_batch_size": 3} | (grpo or {}))),
        JAGGConfig(**({"window_size": 3, "jagg_frac": 0.5} | (jagg or {}))),
        reward=float64_reward(dtype) if reward is None else reward,
        optimizer=optimizer or (lambda p: torch.optim.SGD(p, lr=0.5)),
        evaluation=evaluation,
        seed=seed,
    )
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


def lora_update(module, steps=1, prompts=PROMPTS[:2]):
    before = [p.detach().clone() for p in module.policy.lora_parameters()]
    trainer = fit(module, steps, prompts)
    return [p.detach() - b for p, b in zip(module.policy.lora_parameters(), before)], trainer


class RowCounter:
    """Counts transformer forward calls and the samples (rows) they carry, with a forward pre-hook."""

    def __init__(self, transformer):
        self.calls, self.rows = 0, 0
        self.handle = transformer.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        self.calls += 1
        self.rows += kwargs["hidden_states"].shape[0]


# ---------------------------------------------------------------------------------------------- SDE window
@pytest.mark.parametrize("case", [
    dict(kind="cps", window=3, range=[1, 5], W=3, jagg_frac=0.0, fraction=1.0),  # exact windows in the SDE window
    dict(kind="sde", window=4, range=[0, 6], W=2, jagg_frac=1.0, fraction=0.5),  # W = 2 routed (exact), half of them
])
def test_sde_window_trains_only_its_steps_and_equals_exact_grpo(case, rng_seed):
    seed = rng_seed % 10_000
    module = build(seed, dict(step_kind=case["kind"], sde_window_size=case["window"], sde_window_range=case["range"],
                              noise_level=0.8),
                   dict(train_batch_size=6, max_grad_norm=None), dict(window_size=case["W"], jagg_frac=case["jagg_frac"],
                                                                     window_fraction=case["fraction"]),
                   dtype="float64")
    reference = copy.deepcopy(module)
    update, _ = lora_update(module)
    plan = plan_rollout(module.sampling, module.jagg, 0)
    assert [w.steps for w in plan.windows] == [w.steps for w in module.windows]
    assert plan.trained_steps == [k for w in module.windows for k in w.steps]
    start = plan.stochastic_steps[0]
    lo, hi = case["range"]
    assert plan.stochastic_steps == list(range(start, start + case["window"])) and lo <= start <= hi - case["window"]
    assert set(plan.trained_steps) <= set(plan.stochastic_steps)
    if case["fraction"] < 1:
        assert len(module.windows) == 1  # 2 windows of W = 2 in a 4-step window, half of them trained
    assert {k for r in module.window_records for k in r.steps} == set(plan.trained_steps)  # nothing else trained

    traj, cond, _, rewards, _ = reference.sampler.rollout_and_score(PROMPTS[:2], [0, 1], 0, plan.step_kinds, reward=reference.reward_fn)
    for k, kind in enumerate(plan.step_kinds):
        inside = k in plan.stochastic_steps
        assert kind == (case["kind"] if inside else "ode")
        ode = traj.latents[k] + traj.velocities[k] * (traj.times[k + 1] - traj.times[k])
        assert torch.equal(traj.latents[k + 1], ode) != inside  # deterministic exactly outside the window
        assert (traj.log_probs[k] == 0).all() != inside
    adv = nonzero_advantages(group_advantages(rewards.view(-1, 3)).flatten(), seed)
    expected = [-0.5 * g for g in exact_per_step_gradient(reference.policy, traj, cond, adv, plan.trained_steps,
                                                          kind=case["kind"], noise_level=0.8)]
    assert rel_error(update, expected) < 1e-10


def test_sde_window_start_is_seeded_uniform_and_progressive_is_a_schedule(rng_seed):
    seed = rng_seed % 100_000
    starts = torch.tensor([sde_window_start(seed, step, 3, (0, 5)) for step in range(1500)])
    assert starts.tolist() == [sde_window_start(seed, step, 3, (0, 5)) for step in range(1500)]  # reproducible
    counts = torch.bincount(starts, minlength=3).double()
    assert len(counts) == 3  # Flow-GRPO-Fast: start uniform over [lo, hi - size] = {0, 1, 2}
    assert ((counts / 1500 - 1 / 3).abs() < 5 * (2 / 9 / 1500) ** 0.5).all(), counts  # 5 sigma
    other = [sde_window_start(seed + 1, step, 3, (0, 5)) for step in range(50)]
    assert other != starts[:50].tolist()
    # MixGRPO: slide by the stride every shift_every steps, then stay at the end of the range
    prog = [sde_window_start(seed, step, 4, (1, 9), "progressive", shift_every=5, stride=2) for step in range(30)]
    assert prog == [min(1 + 2 * (step // 5), 5) for step in range(30)]
    with pytest.raises(ValueError, match="cannot hold"):
        sde_window_start(seed, 0, 4, (0, 3))


class PlanRecorder(L.Callback):
    """The SDE window of every rollout, with the optimizer step it started at."""

    def __init__(self):
        self.windows = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.windows.append((trainer.global_step, None))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.windows[-1] = (self.windows[-1][0], pl_module.plan.stochastic_steps)


@pytest.mark.slow
def test_progressive_window_moves_per_rollout_and_resumes(tmp_path, rng_seed):
    """MixGRPO moves the window every shift_every rollouts (train_one_step calls), whatever the number of
    optimizer steps a rollout makes (here 2: two inner epochs); the count survives a checkpoint."""
    seed = rng_seed % 10_000
    sampling = dict(sde_window_size=2, sde_window_range=[0, 5], sde_window_schedule="progressive",
                    sde_window_shift_every=1, noise_level=0.8)
    grpo = dict(train_batch_size=6, inner_epochs=2)
    module, recorder = build(seed, sampling, grpo, dict(window_size=2)), PlanRecorder()
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[recorder], default_root_dir=tmp_path,
                        enable_checkpointing=False)
    trainer.fit(module, PromptDataModule(prompts=PROMPTS[:2], batch_size=2, seed=seed))
    assert recorder.windows == [(0, [0, 1]), (2, [1, 2]), (4, [2, 3])]  # one step of the window per rollout
    assert module.rollouts_done == 3
    path = tmp_path / "two_rollouts.ckpt"
    resumed, again = build(seed, sampling, grpo, dict(window_size=2)), PlanRecorder()
    first = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    first.fit(resumed, PromptDataModule(prompts=PROMPTS[:2], batch_size=2, seed=seed))
    first.save_checkpoint(path)
    resumed = build(seed, sampling, grpo, dict(window_size=2))
    L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=[again], enable_checkpointing=False).fit(
        resumed, PromptDataModule(prompts=PROMPTS[:2], batch_size=2, seed=seed), ckpt_path=path)
    assert again.windows == [(4, [2, 3])]


def test_window_choice_is_seeded_and_sized(rng_seed):
    seed = rng_seed % 100_000
    chosen = [choose_windows(6, 0.5, seed, step) for step in range(200)]
    assert chosen == [choose_windows(6, 0.5, seed, step) for step in range(200)]
    assert all(len(c) == 3 and c == sorted(set(c)) for c in chosen)
    assert len({tuple(c) for c in chosen}) > 10  # it really varies with the step
    assert choose_windows(6, 1.0, seed, 3) == list(range(6)) and len(choose_windows(6, 0.01, seed, 3)) == 1


@pytest.mark.parametrize("build_config,field", [
    (lambda: SamplingConfig(sde_window_size=3, sde_window_range=[0, 2]), "sampling.sde_window_range"),
    (lambda: SamplingConfig(num_steps=10, step_kind="cps", sde_window_size=3, sde_window_range=[5, 10]),
     "sampling.sde_window_range"),
    (lambda: SamplingConfig(sde_window_size=3, trained_steps=4), "sampling.trained_steps"),
    (lambda: JAGGConfig(window_fraction=0.0), "jagg.window_fraction"),
    (lambda: SamplingConfig(train_guidance_scale=0.5), "sampling.train_guidance_scale"),
    (lambda: SamplingConfig(cps_log_prob="exact"), "sampling.cps_log_prob"),
    (lambda: GRPOConfig(std_ddof=2), "grpo.std_ddof"),
    (lambda: GRPOConfig(kl_convention="dt"), "grpo.kl_convention"),
    (lambda: JAGGModule(sampling=SamplingConfig(sde_window_size=2), jagg=JAGGConfig(window_size=3)),
     "jagg.window_size"),
])
def test_sampler_fields_are_checked(build_config, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.") + " must"):
        build_config()


# ---------------------------------------------------------------------------------------------- CFG-free
@pytest.mark.slow
def test_cfg_free_training_makes_one_forward_per_step_and_evaluation_keeps_guidance(rng_seed):
    # skip off: JPEG sizes are whole bytes, so a group of 3 tiny images can tie and be skipped (fewer rows)
    module = build(rng_seed % 10_000, dict(train_guidance_scale=1.0), grpo=dict(skip_zero_advantage=False),
                   evaluation=EvalConfig(num_steps=2, guidance_scale=3.0), guidance_scale=4.5)
    counter = RowCounter(module.policy.transformer)
    steps, samples, micro = 6, 6, 2  # 2 prompts x 3 samples, rollout micro-batches of 3
    rollout, velocity = module.sampler.rollout, module.policy.velocity
    seen, scales = {}, set()

    def guided_velocity(z, t, cond, guidance=None):  # the guidance each velocity call is handed
        scales.add(None if guidance is None else guidance.scale)
        return velocity(z, t, cond, guidance)

    def counted_rollout(*args, **kwargs):  # the rollout's micro-batches (scoring between them runs no transformer)
        calls, rows = counter.calls, counter.rows
        module.policy.velocity = guided_velocity
        try:
            yield from rollout(*args, **kwargs)
        finally:
            del module.policy.velocity
        seen["calls"], seen["rows"], seen["scale"] = counter.calls - calls, counter.rows - rows, scales.pop()
        assert not scales  # one guidance for the whole rollout

    module.sampler.rollout = counted_rollout
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(module, 1)
    # rollout and training micro-batches of 3: only reordering noise (a few ulps), no warning
    assert not [w for w in caught if "importance ratio" in str(w.message)]
    assert module.first_update_ratio_deviation < 1e-5 and not module.first_update_ratio_off
    assert float(trainer.callback_metrics["train/ratio_first_update_off"]) == 0.0
    # one forward per sampling step and micro-batch, one row per sample: no unconditional branch
    assert seen == {"calls": steps * micro, "rows": steps * samples, "scale": 1.0}
    assert len(module.last_rollout.cond) == 2  # (prompt embeds, pooled): no negative prompt either
    training_rows = counter.rows - seen["rows"]
    # and training: every pass carries one row per sample of its micro-batch of 3 (two per routed anchor pair)
    assert training_rows == 3 * sum((2 if r.routed else len(r.steps)) + r.nograd_forwards for r in module.window_records)
    assert any(r.routed for r in module.window_records) and training_rows > 0
    assert module.policy.config.guidance_scale == 4.5  # the config is never changed: guidance is passed
    # evaluation samples with its own guidance: one forward per step carrying both branches (2 rows a sample)
    calls, rows = counter.calls, counter.rows
    module.generate(["a cat"], [0])
    assert (counter.calls - calls, counter.rows - rows) == (2, 4)
    counter.handle.remove()


# ---------------------------------------------------------------------------------------------- zero advantage
class FlatForSomePrompts(Reward):
    """The image mean, except a constant for prompts containing 'flat' (a group with zero advantage)."""

    name = "flat_for_some"

    def score(self, images, prompts):
        flat = torch.tensor(["flat" in p for p in prompts])
        return torch.where(flat, torch.full((len(prompts),), 0.5), images.float().mean(dim=(1, 2, 3)))


@pytest.mark.slow
def test_zero_advantage_groups_make_no_passes_and_change_nothing(rng_seed):
    seed = rng_seed % 10_000
    prompts = ["a red cat", "a flat grey wall"]
    updates, counts = {}, {}
    for skip in (False, True):
        module = build(seed, grpo=dict(skip_zero_advantage=skip, max_grad_norm=None), dtype="float64",
                       reward=FlatForSomePrompts())
        counter = RowCounter(module.policy.transformer)
        updates[skip], trainer = lora_update(module, prompts=prompts)
        counts[skip] = (counter.rows, sum(r.backwards for r in module.window_records), module.skipped_samples,
                        float(trainer.callback_metrics["train/skipped_samples"]))
    assert sum(float(u.abs().sum()) for u in updates[False]) > 0
    assert rel_error(updates[True], updates[False]) < 1e-10
    rollout_rows = 6 * 6
    rows_kept, rows_all = counts[True][0] - rollout_rows, counts[False][0] - rollout_rows
    assert counts[False][2:] == (0, 0.0) and counts[True][2:] == (3, 3.0)
    # the 3 samples of the flat group got no forward at all: micro-batches of 3 -> one instead of two
    assert rows_kept * 2 == rows_all and counts[True][1] * 2 == counts[False][1]


def test_all_zero_advantage_update_is_the_zero_gradient_step(rng_seed):
    module = build(rng_seed % 10_000, reward=FlatForSomePrompts(),
                   optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))
    expected = [p.detach().clone().requires_grad_() for p in module.policy.lora_parameters()]
    reference = torch.optim.AdamW(expected, lr=1e-2, weight_decay=0.1)
    for p in expected:
        p.grad = torch.zeros_like(p)
    reference.step()  # what the update with every (zero-gradient) sample included does: AdamW's decay
    fit(module, 1, ["a flat wall", "a flat floor"])
    assert module.skipped_samples == 6 and not module.window_records  # not one pass
    assert all(torch.equal(p, e) for p, e in zip(module.policy.lora_parameters(), expected))


# ---------------------------------------------------------------------------------------------- ratio warning
def _first_update_stats(log_ratio, old_log_prob):
    """One micro-batch's first-update diagnostics, as the unfused update collects them ([B] per sample)."""
    zeros = torch.zeros_like(log_ratio)
    return [(None, StepLossStats(policy_loss=zeros, kl=zeros, ratio=log_ratio.exp(), approx_kl=0.5 * log_ratio**2,
                                 clipped=zeros, log_ratio=log_ratio, old_log_prob=old_log_prob))]


@pytest.mark.parametrize("rollout_batch_size", [1, 3])  # train_batch_size 3: mismatched, matched
def test_first_update_ratio_check_names_the_cause(rollout_batch_size, rng_seed):
    """Mismatched batch sizes in float32: any drift is reported and blamed on the mismatch. Matched sizes:
    drift within 4 eps (1 + |log pi_old|) is float noise; beyond it the forward is blamed."""
    torch.manual_seed(rng_seed)
    check = FirstUpdateRatioCheck(SamplingConfig(num_steps=4, group_size=3, rollout_batch_size=rollout_batch_size),
                                  GRPOConfig(train_batch_size=3), JAGGConfig(window_size=2), torch.float32)
    old = -torch.rand(6, dtype=torch.float64) * 5
    eps = torch.finfo(torch.float32).eps
    ulp_drift = torch.zeros(6, dtype=torch.float64)
    i = torch.randint(6, ())
    ulp_drift[i] = eps * (1 + old[i].abs())  # a quarter of the noise bound
    if rollout_batch_size == 1:
        assert re.search(r"deviates from 1 .*grpo\.train_batch_size \(3\) differs from sampling\.rollout_batch_size \(1\)",
                         check(_first_update_stats(ulp_drift, old)))
        assert check.off
    else:
        assert check(_first_update_stats(ulp_drift, old)) is None
        assert not check.off
        assert re.search(r"deviates from 1 .*beyond float noise .*nondeterministic kernels",
                         check(_first_update_stats(ulp_drift * 100, old)))
        assert check.off
    assert check.deviation == pytest.approx(float(ulp_drift.abs().max()) * (1 if rollout_batch_size == 1 else 100))
    assert check(_first_update_stats(ulp_drift * 100, old)) is None and check.off  # the text comes once


@pytest.mark.slow
def test_first_update_ratio_with_mismatched_batch_sizes_is_reported_in_fit(rng_seed):
    """End to end in float32 with train_batch_size 3 != rollout_batch_size 1: whether the kernels round
    differently for batch 1 and batch 3 depends on the CPU's BLAS, so the property is that any drift is
    reported (warning and metric) and stays float noise, and none is reported without drift."""
    seed = rng_seed % 10_000
    mismatched = build(seed, dict(rollout_batch_size=1))  # train_batch_size 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(mismatched, 1)
    warned = [w for w in caught if "importance ratio of the first update" in str(w.message)]
    drift = mismatched.first_update_ratio_deviation
    assert 0 <= drift < 1e-5
    assert mismatched.first_update_ratio_off == (drift > 0) == bool(warned)
    assert float(trainer.callback_metrics["train/ratio_first_update_off"]) == float(drift > 0)
    assert float(trainer.callback_metrics["train/ratio_dev_first_update"]) == pytest.approx(drift)
    if warned:
        assert "grpo.train_batch_size (3) differs from sampling.rollout_batch_size (1)" in str(warned[0].message)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,rollout_batch_size", [("float32", 3), ("float64", 1)])
def test_first_update_ratio_does_not_warn_when_it_is_one(dtype, rollout_batch_size, rng_seed):
    """float32 with matched sizes, and float64 even with mismatched ones: no warning, metric 0."""
    seed = rng_seed % 10_000
    module = build(seed, dict(rollout_batch_size=rollout_batch_size), dtype=dtype)  # train_batch_size 3
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*importance ratio of the first update")
        trainer = fit(module, 1)
    assert not module.first_update_ratio_off
    assert float(trainer.callback_metrics["train/ratio_first_update_off"]) == 0.0
    assert module.first_update_ratio_deviation < (1e-12 if dtype == "float64" else 1e-6)
    # the advantages in the GRPO math's dtype: float64 in a float64 run, float32 (the rewards' own) else
    assert module.last_rollout.advantages.dtype == (torch.float64 if dtype == "float64" else torch.float32)
