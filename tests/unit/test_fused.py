"""The fused on-policy mode (``jagg.fused_rollout``): the rollout keeps the graphs of the steps that get a
backward, and each micro-batch's update runs as soon as it is sampled. Same gradient as the unfused
update (float64), no repeated forward, and the settings it cannot serve are refused."""

import lightning as L
import pytest
import torch

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, MemoryConfig, SamplingConfig
from jagg_lightning.data import PromptDataModule
from jagg_lightning.training.passes import fused_graph_steps, fused_samples, pass_plan

from helpers import float64_reward, randomize_lora_b, rel_error, tiny_policy_config

PROMPTS = ["a red cat", "a blue dog"]
K = 3


MEMORY = {"budget_mb", "anchors", "fused_samples", "fused_interior_graphs"}  # the memory section's fields


def build(seed, fused, dtype="float64", rollout_batch_size=6, guidance=1.0, kl_beta=0.0, sampling=None, **options):
    """The tiny SD3 on SGD (lr 1: the update is minus the gradient); ``options``: jagg and memory fields;
    ``sampling``: sampling fields."""
    memory = {k: options.pop(k) for k in list(options) if k in MEMORY}
    module = JAGGModule(
        tiny_policy_config(dtype=dtype, guidance_scale=guidance),
        SamplingConfig(**({"num_steps": 7, "group_size": K, "rollout_batch_size": rollout_batch_size}
                          | (sampling or {}))),
        GRPOConfig(train_batch_size=4, max_grad_norm=None, kl_beta=kl_beta, adv_std="group"),
        JAGGConfig(**({"window_size": 3, "fused_rollout": fused} | options)),
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        memory=MemoryConfig(**memory),
        reward=float64_reward(dtype),
        seed=seed,
    )
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


def fit_once(module, prompts=PROMPTS):
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    before = [p.detach().clone() for p in module.policy.lora_parameters()]
    trainer.fit(module, PromptDataModule(prompts=prompts, batch_size=len(prompts), shuffle=False))
    update = [p.detach() - b for p, b in zip(module.policy.lora_parameters(), before)]
    metrics = {k[len("train/passes/"):]: float(v) for k, v in trainer.callback_metrics.items()
               if k.startswith("train/passes/")}
    return update, metrics


FLASH = dict(trained_steps=4, ode_after_trained=True, ode_solver="dpmpp_2m", ode_steps=2)
CASES = {
    "exact": dict(jagg_frac=0.0),
    "disjoint": dict(jagg_frac=1.0),
    "chained": dict(jagg_frac=1.0, chained=True),
    "routed half, one micro-batch": dict(jagg_frac=0.5),
    "routed half, exact interiors re-run": dict(jagg_frac=0.5, fused_interior_graphs=False),
    "graphs for part of each micro-batch": dict(jagg_frac=1.0, fused_samples=2, rollout_batch_size=3),
    "several micro-batches, split anchors": dict(jagg_frac=1.0, rollout_batch_size=3, anchors="split"),
    # the cheaper rollout (MixGRPO-Flash): 4 trained steps of 7, the ODE tail in 2 DPM-Solver++(2M) steps
    "flash tail, exact": dict(jagg_frac=0.0, rollout_batch_size=3, sampling=FLASH),
    "flash tail, routed": dict(jagg_frac=1.0, rollout_batch_size=3, sampling=FLASH | {"ode_steps": 3}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_gradient_equals_unfused(case, rng_seed):
    seed = rng_seed % 10_000
    options = dict(CASES[case])
    unfused, fused = build(seed, False, **options), build(seed, True, **options)
    unfused_update, unfused_passes = fit_once(unfused)
    fused_update, fused_passes = fit_once(fused)
    assert sum(float(u.abs().sum()) for u in unfused_update) > 0
    assert rel_error(fused_update, unfused_update) < 1e-10
    # a float64 run's advantages are float64 (Sampler.scored): the fused mode's, per rollout micro-batch, are the
    # unfused whole rollout's (in float32 a group mean rounds by the reward tensor's shape: 1 group in 10^3 to 10^4)
    advantages = fused.last_rollout.advantages
    assert advantages.dtype == torch.float64
    torch.testing.assert_close(advantages, unfused.last_rollout.advantages, rtol=1e-13, atol=1e-13)
    # the same windows did the same work; the fused mode took its forwards with grad from the rollout
    assert fused_passes["routed_windows"] > 0 or options["jagg_frac"] == 0
    assert fused_passes["fused_forward"] > 0 and unfused_passes["fused_forward"] == 0
    if "fused_samples" not in options:  # (a part's rest runs unfused: as many passes, on fewer samples)
        assert fused_passes["grad_forward"] < unfused_passes["grad_forward"]
    if "sampling" in options:  # the rollout: the 4 trained steps, then ode_steps tail steps; the first ratio is 1
        assert len(fused.last_rollout.trajectory.times) == 4 + options["sampling"]["ode_steps"] + 1
        assert unfused.first_update_ratio_deviation < 1e-12 and fused.first_update_ratio_deviation < 1e-12


@pytest.mark.parametrize("fused,options", [(True, dict(fused_samples=2)), (False, dict(budget_mb=1e-3))])
def test_routing_stats_count_exact_passes_when_micro_batches_are_split(fused, options, rng_seed):
    """Split micro-batches (part of each sample set kept as graphs, or a tiny memory budget) make more
    window records than micro-batches; the backwards saved still compare with exact GRPO's count."""
    from jagg_lightning.callbacks import RoutingStats

    module = build(rng_seed % 10_000, fused, jagg_frac=1.0, rollout_batch_size=3, **options)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[RoutingStats(plot=False)])
    trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=len(PROMPTS), shuffle=False))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    micro_batches = -(-len(PROMPTS) * K // 4) if not fused else len(PROMPTS) * K // 3  # update / rollout ones
    assert len(module.window_records) > len(module.windows) * micro_batches  # really split
    assert metrics["train/passes/exact_backward"] == len(module.trained_steps) * micro_batches
    assert metrics["routing/backward_saved"] == metrics["train/passes/exact_backward"] - metrics["train/passes/backward"]
    # fused: one backward per part; a budget of a fraction of one sample makes one-sample passes, more
    # than exact GRPO's one per trained step and micro-batch: a negative saving, reported as such
    assert (metrics["routing/backward_saved"] > 0) == fused


@pytest.mark.parametrize("kl_beta,guidance", [(0.0, 2.5), (0.3, 1.0)])
def test_fused_gradient_equals_unfused_with_guidance_and_kl(kl_beta, guidance, rng_seed):
    seed = rng_seed % 10_000
    options = dict(jagg_frac=1.0, rollout_batch_size=3, guidance=guidance, kl_beta=kl_beta)
    unfused_update, _ = fit_once(build(seed, False, **options))
    fused_update, _ = fit_once(build(seed, True, **options))
    assert rel_error(fused_update, unfused_update) < 1e-10


def test_fused_disjoint_makes_no_forward_beyond_the_rollout(rng_seed):
    """8 trained steps, W = 3, all routed: windows (0 1 2) (3 4 5) and the exact tail (6 7). Unfused: one
    batched anchor pass per routed window plus two for the tail = 4 forwards with grad and 4 backwards
    per micro-batch. Fused: the six pass steps (0 2 3 5 6 7) come from the rollout, ONE backward per
    micro-batch, and the interiors (1 4) from the rollout's velocities."""
    module = JAGGModule(tiny_policy_config(), SamplingConfig(num_steps=9, group_size=K,
                        rollout_batch_size=3), GRPOConfig(adv_std="group"),
                        JAGGConfig(window_size=3, jagg_frac=1.0, fused_rollout=True), seed=rng_seed % 10_000)
    module.configure_model()
    _, passes = fit_once(module)
    # a micro-batch (3 samples = one group) whose rewards tie has zero advantages and is skipped: no passes
    skipped = int(module.trainer.callback_metrics["train/skipped_samples"]) // 3
    micro_batches = len(PROMPTS) * K // 3 - skipped
    assert passes["grad_forward"] == 0 and passes["nograd_forward"] == 0
    assert passes["fused_forward"] == 6 * micro_batches
    assert passes["backward"] == micro_batches
    assert fused_graph_steps(module.windows, module.jagg, module.memory) == {0, 2, 3, 5, 6, 7}
    assert module.first_update_ratio_deviation < 1e-12  # the kept graph IS the rollout's forward


def test_kl_reference_is_taken_inside_the_rollout(rng_seed):
    """The reference velocities the rollout records equal a separate adapter-off pass over the trajectory."""
    module = build(rng_seed % 10_000, False, dtype="float32", kl_beta=0.1, rollout_batch_size=4)
    traj, cond, *_ = module.sampler.rollout_and_score(PROMPTS[:2], [0, 1], 0, module.plan.step_kinds,
                                                      module.plan.trained_steps, reward=module.reward_fn)
    separate = module.sampler.reference_velocities(traj, cond, module.plan.trained_steps)
    assert traj.ref_velocities is not None and separate.abs().sum() > 0
    assert torch.equal(traj.ref_velocities, separate)
    # ... and differ from the policy's own (the adapter is on in the rollout)
    assert not torch.allclose(traj.ref_velocities[0], traj.velocities[0])


@pytest.mark.parametrize(
    "sampling,grpo,field",
    [
        ({}, {"inner_epochs": 2}, "grpo.inner_epochs"),
        ({}, {"micro_batches_per_update": 1}, "grpo.micro_batches_per_update"),
        ({"rollout_batch_size": 4}, {}, "sampling.rollout_batch_size"),
        ({}, {"adv_std": "global"}, "grpo.adv_std"),
    ],
)
def test_fused_refuses_what_it_cannot_serve(sampling, grpo, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.") + ".*fused_rollout") as info:
        JAGGModule(tiny_policy_config(), SamplingConfig(**({"group_size": 3, "rollout_batch_size": 6} | sampling)),
                   GRPOConfig(**({"adv_std": "group"} | grpo)), JAGGConfig(window_size=3, fused_rollout=True))
    assert "must" in str(info.value)


def test_memory_budget_picks_the_pass_layout_and_keeps_the_gradient(rng_seed):
    """The budget, in units of one sample's measured activations a: >= 2 n a batches the anchors of all n
    samples; between n a and 2 n a splits them; below, passes take fewer samples. The gradient is the
    same in every layout (float64), and the pass counts grow as the passes shrink."""
    seed = rng_seed % 10_000
    reference_update, reference_passes = fit_once(build(seed, False, jagg_frac=1.0))
    probe = build(seed, False, jagg_frac=1.0)
    a = probe.sampler.activation_bytes()
    # linear in the samples of a pass: four samples keep four times one sample's activations (within 10 %)
    assert 3.6 * a < probe.sampler.activation_bytes(samples=4) < 4.4 * a
    assert a > 0
    # 6 trained steps, W = 3, all routed: R = 2 windows, E = 0 exact steps
    probe.updater.route(probe.sampler.trajectories(PROMPTS[:1], [0], 0)[0], probe.windows)
    windows = probe.windows
    assert sum(w.routed for w in windows) == 2
    layouts = {8 * a: (4, 4, False),  # 2 batched passes of 4 beat 4 split passes
               3 * a: (3, 3, True),   # n = 3: batched c_b = 1 makes 6 passes, split c_s = 3 makes 4
               1.5 * a: (4, 1, True)}  # not even a batched single sample fits: split, one sample a pass
    for budget, (n, size, split) in layouts.items():
        module = build(seed, False, jagg_frac=1.0, budget_mb=budget / 2**20)
        assert pass_plan(n, windows, module.memory, module.sampler.activation_bytes) == (size, split), budget / a
        update, passes = fit_once(module)
        assert rel_error(update, reference_update) < 1e-10
        assert passes["backward"] >= reference_passes["backward"]
    assert passes["backward"] > reference_passes["backward"]
    # the fused mode keeps graphs for as many samples as the budget holds for its kept steps (0 2 3 5)
    fused = build(seed, True, jagg_frac=1.0, budget_mb=4 * 2 * a / 2**20)
    assert fused_graph_steps(fused.windows, fused.jagg, fused.memory) == {0, 2, 3, 5}
    assert fused_samples(4, fused.memory, fused.sampler.activation_bytes) == 2
    update, passes = fit_once(fused)
    assert rel_error(update, reference_update) < 1e-10 and passes["fused_forward"] > 0


@pytest.mark.parametrize("fused", [False, True])
def test_interpolated_reference_inside_routed_windows(fused, rng_seed):
    """``interpolate_reference``: the rollout takes the reference only where a backward is certain (the
    anchors); after routing, a routed window's interior reference is the alpha-interpolation of its
    anchors' and an exact window's is a real adapter-off forward. Fused and unfused agree (float64)."""
    from jagg_lightning.method.jagg import alphas

    seed = rng_seed % 10_000
    options = dict(jagg_frac=0.5, kl_beta=0.2, interpolate_reference=True)
    module = build(seed, fused, **options)
    update, passes = fit_once(module)
    batch, windows = module.last_rollout, module.windows
    ref, traj = batch.trajectory.ref_velocities, batch.trajectory
    separate = module.sampler.reference_velocities(traj, batch.cond, module.plan.trained_steps)
    routed = [w for w in windows if w.routed]
    exact = [w for w in windows if not w.routed]
    assert len(routed) == 1 and len(exact) == 1
    for w in windows:
        a, b = w.anchors
        for k in (a, b):
            assert torch.equal(ref[k], separate[k])
        for k in w.interior:
            if w.routed:
                alpha = alphas(traj.times, w.steps)[w.steps.index(k)]
                assert torch.allclose(ref[k], (1 - alpha) * separate[a] + alpha * separate[b], rtol=0, atol=1e-12)
                assert not torch.allclose(ref[k], separate[k])
            else:
                assert torch.equal(ref[k], separate[k])
    # 6 trained steps in one micro-batch: 4 anchors in the rollout + the exact window's interior = 5 forwards
    assert passes["reference_forward"] == 5
    if fused:
        unfused_update, _ = fit_once(build(seed, False, **options))
        assert rel_error(update, unfused_update) < 1e-10


def test_fused_gradient_equals_unfused_on_an_editing_twin(rng_seed):
    """FLUX.1 Kontext (float64, KL on, both W = 3 windows' anchors fused): the source's tokens travel in the condition
    through the kept graphs and the rollout's reference forwards exactly as through the unfused passes."""
    from family_cases import CONDITIONED_PROMPTS

    seed = rng_seed % 10_000

    def kontext(fused):
        module = JAGGModule(
            tiny_policy_config(family="flux_kontext", lora_targets=None, dtype="float64", guidance_scale=2.5),
            SamplingConfig(num_steps=6, group_size=2, rollout_batch_size=4),
            GRPOConfig(train_batch_size=4, max_grad_norm=None, kl_beta=0.2, adv_std="group"),
            JAGGConfig(window_size=3, jagg_frac=1.0, fused_rollout=fused), optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
            reward=float64_reward("float64"), seed=seed)
        module.configure_model()
        randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
        return module

    (unfused_update, _), (fused_update, fused_passes) = (fit_once(kontext(f), CONDITIONED_PROMPTS) for f in (False, True))
    assert sum(float(u.abs().sum()) for u in unfused_update) > 0
    assert fused_passes["fused_forward"] > 0 and fused_passes["routed_windows"] > 0
    assert rel_error(fused_update, unfused_update) < 1e-10
