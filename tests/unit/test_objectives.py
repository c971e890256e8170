"""The forward-process objectives (DiffusionNFT, AWM; ``jagg_lightning/objectives/``): each loss and its LoRA gradient
against a float64 transcription of the paper's formula written here independently, on the real tiny SD3; JAGG over K
noise levels exact on the affine toy and not on a sine-time one; backward calls counted (1 joint vs K); the config's
checks; theta_old's soft-update schedule."""

import pytest
import torch

from jagg_lightning import GRPOConfig, JAGGConfig, MemoryConfig, ObjectiveConfig, SamplingConfig
from jagg_lightning.method.jagg import Window, flat_gradient
from jagg_lightning.objectives import OBJECTIVES, build_objective
from jagg_lightning.objectives.forward_process import ForwardProcessUpdater, MatchingPoint, OldPolicy, noise_levels
from jagg_lightning.objectives.nft import nft_decay
from jagg_lightning.training.sampler import Sampler
from jagg_lightning.training.update import StepReport

from helpers import build_policy, randomize_lora_b, rel_error, velocities_with
from toy import AffineLoRAVelocity, SineTimeVelocity

B, K = 2, 4


def transcription(name, v, v_old, v_ref, x0, eps, z, t, adv, config):
    """The papers' per-sample losses, written out in float64 (reference code conventions: docs/method.md)."""
    mean = lambda x: x.flatten(1).mean(1)  # noqa: E731
    kl_beta = config.kl_beta if config.kl_beta is not None else {"nft": 1e-4, "awm": 0.0}[name]
    kl = mean((v - v_ref) ** 2)
    if name == "awm":
        mse = mean((v - (eps - x0)) ** 2)
        if config.awm_weighting == "ghuber":
            p = config.awm_ghuber_power
            return adv * t * (torch.pow(mse + 1e-10, p) - 1e-10**p) / p + kl_beta * kl
        w = {"uniform": 1.0, "t": t, "t2": t**2}[config.awm_weighting]
        return adv * w * mse + kl_beta * kl
    beta, c = config.nft_beta, config.nft_adv_clip
    positive, negative = beta * v + (1 - beta) * v_old, (1 + beta) * v_old - beta * v
    losses = []
    for policy_v in (positive, negative):
        x0_hat = z - t * policy_v
        weight = mean((x0_hat - x0).abs()).detach().clamp(min=1e-5)
        losses.append(mean((x0_hat - x0) ** 2) / weight)
    r = torch.clamp((torch.clamp(adv, -c, c) / c) / 2.0 + 0.5, 0, 1)
    return c * (r * losses[0] + (1 - r) * losses[1]) / beta + kl_beta * kl


@pytest.fixture(scope="module")
def tiny_sd3():
    """One float64 tiny SD3 for the module (building it is the slow part); each test draws fresh LoRA weights."""
    return build_policy(torch.Generator().manual_seed(0), dtype="float64", resolution=64)


def tiny_setup(policy, seed, config):
    gen = torch.Generator().manual_seed(seed)
    randomize_lora_b(policy.transformer, gen)
    for p in policy.lora_parameters():
        p.grad = None
    sampling = SamplingConfig(num_steps=6, group_size=B, rollout_batch_size=B)
    objective = build_objective(config)
    sampler = Sampler(policy, sampling, 0.0)
    updater = objective.updater(policy, sampling, GRPOConfig(train_batch_size=B), JAGGConfig(window_size=2),
                                MemoryConfig(), sampler)
    updater.guard.start_rollout([0], sampler.device)
    cond = sampler.encode(["a red cat"])
    x0 = torch.randn(B, *policy.latent_shape, generator=gen, dtype=torch.float64)
    eps = torch.randn(B, 1 if config.shared_noise else K, *policy.latent_shape, generator=gen, dtype=torch.float64)
    times = noise_levels("uniform", K, sampler.times, 1.0, gen)
    adv = 2.5 * torch.randn(B, generator=gen, dtype=torch.float64)  # some beyond the NFT clip
    return policy, sampler, updater, cond, x0, eps, times, adv, gen


CASES = {  # (config, theta_old: "theta" -- v_old is v_theta detached, no forward -- or a lagging copy)
    "nft, theta_old = theta": (ObjectiveConfig(name="nft"), "theta"),
    "nft beta 0.1, kl, lagging theta_old": (ObjectiveConfig(name="nft", nft_beta=0.1, kl_beta=0.05, nft_adv_clip=2.0),
                                            "lagging"),
    "awm": (ObjectiveConfig(name="awm"), "theta"),
    "awm ghuber": (ObjectiveConfig(name="awm", awm_weighting="ghuber", awm_ghuber_power=0.3), "theta"),
    "awm t-weighted, kl, one eps": (ObjectiveConfig(name="awm", awm_weighting="t", kl_beta=0.3, shared_noise=True),
                                    "theta"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_equal_the_papers_formula(case, tiny_sd3, rng_seed):
    """The update's loss and gradient over K levels (exact passes) equal the float64 transcription's, < 1e-10;
    NFT's v_old from theta_old (a lagging copy, or theta itself: then no forward of its own)."""
    config, theta_old = CASES[case]
    policy, sampler, updater, cond, x0, eps, times, adv, gen = tiny_setup(tiny_sd3, rng_seed % 100_000, config)
    params = list(policy.lora_parameters())
    old = None
    if theta_old == "lagging":
        old = OldPolicy(params)
        for s in old.shadow:
            s.add_(0.05 * torch.randn(s.shape, generator=gen, dtype=s.dtype))
        old.matches = False
    kl_on = updater.objective.kl_beta > 0
    report = StepReport(cond)
    for p in params:
        p.grad = None
    records = updater.backward_points(x0, eps, adv, cond, times, B, report, torch.Tensor.backward,
                                      torch.arange(B), old)
    got = [p.grad.clone() for p in params]
    assert sum(r.backwards for r in records) == K and not records[0].routed
    # the loss value: the logged per-sample parts, l = policy + kl_beta kl, mean over samples and levels
    got_loss = sum(st.policy_loss + updater.objective.kl_beta * st.kl for _, st in report.stats).mean() / K

    # the transcription: the model called directly, v_old with theta_old's weights swapped in by hand
    noises = [eps[:, 0 if config.shared_noise else k] for k in range(K)]
    zs = [(1 - t) * x0 + t * noise for t, noise in zip(times, noises)]
    with torch.no_grad():
        v_refs = [sampler.reference_velocity(z, t.expand(B), cond) if kl_on else torch.zeros_like(z)
                  for z, t in zip(zs, times)]
    v_olds = [None] * K if old is None else velocities_with(old.shadow, params, sampler.velocity, zs, times, B, cond)
    total = 0
    for k in range(K):
        v = sampler.velocity(zs[k], times[k].expand(B), cond)
        v_old = v.detach() if v_olds[k] is None else v_olds[k]
        total = total + transcription(config.name, v, v_old, v_refs[k], x0, noises[k], zs[k], times[k], adv,
                                      config).mean() / K
    want = torch.autograd.grad(total, params)
    assert abs(float(got_loss - total.detach())) <= 1e-10 * max(1.0, abs(float(total.detach())))
    assert sum(float(g.abs().sum()) for g in want) > 0
    assert rel_error(got, want) < 1e-10


def toy_points(model, config, gen):
    """K levels of B toy samples on one line each (one eps per sample), the objective's loss per level."""
    objective = build_objective(config)
    objective.group_size = B  # DGPO's group weight: the B samples are one group
    shape = (B, *model.shape)
    x0, eps = torch.randn(shape, generator=gen, dtype=torch.float64), torch.randn(shape, generator=gen, dtype=torch.float64)
    times = noise_levels("logit_normal", K + 2, torch.ones(2), 1.0, gen)
    latents = torch.stack([(1 - t) * x0 + t * eps for t in times])
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    v_old = [model(latents[k], times[k].expand(B)).detach() + 0.1 for k in range(len(times))]

    def loss(k, v):
        point = MatchingPoint(x0, eps, times[k], latents[k], adv, v_old[k], v_old[k] - 0.2, torch.zeros(B, dtype=int))
        return objective.point_loss(v, point)[0].mean()

    return latents, times, loss


@pytest.mark.parametrize("name", ["nft", "awm", "dgpo"])
def test_jagg_over_noise_levels_is_exact_on_the_affine_toy(name, rng_seed):
    """z_t = (1 - t) x0 + t eps is on the chord between the extreme levels, so for a velocity affine in (z, t) the
    interpolated Jacobian is exact: JAGG = the K-pass gradient (< 1e-10); with a sinusoidal time embedding it is not.
    (DGPO: its group weights held fixed, as the released code holds them; a reference and a lagging theta_old.)"""
    gen = torch.Generator().manual_seed(rng_seed)
    config = ObjectiveConfig(name=name, shared_noise=True, jagg=True, num_levels=K + 2)
    errors = {}
    for model_class in (AffineLoRAVelocity, SineTimeVelocity):
        model = model_class(generator=gen)
        latents, times, loss = toy_points(model, config, gen)
        steps = tuple(range(len(times)))
        exact = flat_gradient(model, model.parameters(), latents, times, None, loss, [Window(steps, routed=False)])
        jagg = flat_gradient(model, model.parameters(), latents, times, None, loss, [Window(steps, routed=True)])
        assert exact.norm() > 0
        errors[model_class.__name__] = float((jagg - exact).norm() / exact.norm())
    assert errors["AffineLoRAVelocity"] < 1e-10
    assert errors["SineTimeVelocity"] > 1e-6


def test_jagg_over_noise_levels_makes_one_backward(tiny_sd3, rng_seed):
    """On the tiny SD3: K levels exact take K backward calls, with ``objective.jagg`` ONE (counted by a hook on the
    backward call and in the records), two grad forwards and K - 2 no-grad ones."""
    counts = {}
    for jagg in (False, True):
        config = ObjectiveConfig(name="awm", shared_noise=True, jagg=jagg, num_levels=K)
        policy, sampler, updater, cond, x0, eps, times, adv, _ = tiny_setup(tiny_sd3, rng_seed % 100_000, config)
        calls = []
        records = updater.backward_points(x0, eps, adv, cond, times, B, StepReport(cond),
                                          lambda loss: calls.append(1) or loss.backward(), torch.arange(B), None)
        counts[jagg] = (len(calls), sum(r.backwards for r in records), records[0].grad_forwards,
                        records[0].nograd_forwards)
    assert counts[False] == (K, K, K, 0)
    assert counts[True] == (1, 1, 1, K - 2)  # the two extreme levels batched in one forward


def test_level_windows():
    """``objective.jagg_window``: routed windows of that many levels, a shorter tail exact; without jagg one exact
    window of all K."""
    updater = object.__new__(ForwardProcessUpdater)
    updater.config = ObjectiveConfig(name="awm", shared_noise=True, jagg=True, jagg_window=3)
    assert [(w.steps, w.routed) for w in updater.level_windows(8)] == [
        ((0, 1, 2), True), ((3, 4, 5), True), ((6, 7), False)]
    updater.config = ObjectiveConfig(name="awm", shared_noise=True, jagg=True)
    assert [(w.steps, w.routed) for w in updater.level_windows(5)] == [((0, 1, 2, 3, 4), True)]
    updater.config = ObjectiveConfig(name="awm")
    assert [(w.steps, w.routed) for w in updater.level_windows(5)] == [((0, 1, 2, 3, 4), False)]


def test_theta_old_soft_update_schedule():
    """DiffusionNFT's decay_type schedules, and theta_old <- d theta_old + (1 - d) theta (d = 0: a copy, and it then
    matches theta so the rollout needs no swap)."""
    assert [nft_decay(s, 0) for s in (0, 10, 1000)] == [0.0, 0.0, 0.0]
    assert [nft_decay(s, 1) for s in (0, 100, 499, 10_000)] == pytest.approx([0.0, 0.1, 0.499, 0.5])
    assert [nft_decay(s, 2) for s in (0, 75, 76, 10_000)] == pytest.approx([0.0, 0.0, 0.0075, 0.999])
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    old = OldPolicy([p])
    assert old.matches
    with torch.no_grad():
        p.add_(1.0)
    old.soft_update(0.25)
    assert not old.matches and torch.equal(old.shadow[0], 0.25 * torch.tensor([1.0, 2.0]) + 0.75 * p.detach())
    with old.applied():
        assert torch.equal(p.detach(), old.shadow[0])
    assert torch.equal(p.detach(), torch.tensor([2.0, 3.0], dtype=torch.float64))
    old.soft_update(0.0)
    assert old.matches and torch.equal(old.shadow[0], p.detach())


def test_noise_levels():
    """Distinct schedule times in decreasing order; shifted draws in (0, 1)."""
    gen = torch.Generator().manual_seed(0)
    schedule = torch.linspace(1, 0, 11)
    t = noise_levels("schedule", 9, schedule, 1.0, gen)
    assert len(set(t.tolist())) == 9 and set(t.tolist()) <= set(schedule[:-1].double().tolist())
    assert torch.all(t[:-1] > t[1:])
    for kind in ("uniform", "logit_normal"):
        t = noise_levels(kind, 50, schedule, 3.0, gen)
        assert torch.all((t > 0) & (t < 1)) and torch.all(t[:-1] >= t[1:])


@pytest.mark.parametrize("field, value, words", [
    ("name", "ppo", "objective.name"),
    ("num_levels", 0, "objective.num_levels"),
    ("levels", "beta", "objective.levels"),
    ("level_shift", 0.0, "objective.level_shift"),
    ("kl_beta", -1.0, "objective.kl_beta"),
    ("nft_beta", 1.5, "objective.nft_beta"),
    ("nft_adv_clip", 0.0, "objective.nft_adv_clip"),
    ("nft_decay_type", 3, "objective.nft_decay_type"),
    ("awm_weighting", "t3", "objective.awm_weighting"),
    ("awm_ghuber_power", 0.0, "objective.awm_ghuber_power"),
    ("jagg_window", 2, "objective.jagg_window"),
    ("jagg", True, "objective.shared_noise"),
])
def test_bad_objective_fields_name_the_field(field, value, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        ObjectiveConfig(**{"name": "nft", field: value})


def test_checks_across_sections():
    """Schedule levels are distinct times of the rollout's schedule; a JAGG window needs 3 levels or more."""
    with pytest.raises(ValueError, match=r"objective\.num_levels.*sampling\.num_steps=6"):
        build_objective(ObjectiveConfig(name="awm", num_levels=7), SamplingConfig(num_steps=6), None, None)
    with pytest.raises(ValueError, match=r"objective\.num_levels.*>= 3"):
        build_objective(ObjectiveConfig(name="awm", num_levels=2, shared_noise=True, jagg=True),
                        SamplingConfig(num_steps=6), None, None)
    assert set(OBJECTIVES) == {"grpo", "nft", "awm", "dgpo", "flow_dppo"}
    assert ObjectiveConfig(name="nft").levels_for(10) == 9  # the NFT code's timestep_fraction 0.99 of 10 steps
