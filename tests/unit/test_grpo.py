import pytest
import torch

from jagg_lightning.method.grpo import StepRecord, global_reward_std, group_advantages, step_loss
from jagg_lightning.method.sde import flow_match_sigmas, sample_step, step_distribution


def test_advantages_zero_mean_per_group_and_constant_groups_zero(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    rewards = torch.randn(5, 6, generator=gen)
    rewards[2] = 0.37  # a constant group
    for std in ("group", "global"):
        adv = group_advantages(rewards, std=std, adv_clip=100.0)
        assert torch.isfinite(adv).all()
        torch.testing.assert_close(adv.mean(dim=1), torch.zeros(5), atol=1e-6, rtol=0)
        assert (adv[2] == 0).all()
    adv = group_advantages(rewards, "group", adv_clip=100.0)
    # unit std inside non-constant groups (up to eps): ddof 0 by default (np.std, Flow-GRPO) ...
    torch.testing.assert_close(adv[[0, 1, 3, 4]].std(dim=1, correction=0), torch.ones(4), atol=1e-3, rtol=0)
    # ... and the unbiased std with ddof = 1
    adv = group_advantages(rewards, "group", adv_clip=100.0, ddof=1)
    torch.testing.assert_close(adv[[0, 1, 3, 4]].std(dim=1), torch.ones(4), atol=1e-3, rtol=0)


def test_advantage_clipping(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    rewards = torch.randn(4, 8, generator=gen)
    rewards[:, 0] = 1e3  # outliers far beyond the clip
    adv = group_advantages(rewards, "group", adv_clip=1.5)
    assert adv.abs().max() <= 1.5 + 1e-7
    assert (adv[:, 0] == 1.5).all()


@pytest.mark.parametrize("ddof", [0, 1])
def test_global_std_from_summed_moments_equals_std_of_all_rewards(ddof, rng_seed):
    """Three 'processes' whose moments are summed, as one all-reduce would, give the std of the union."""
    gen = torch.Generator().manual_seed(rng_seed)
    rewards = 50.0 + 0.5 * torch.randn(6, 4, generator=gen, dtype=torch.float64)  # mean = 100 std: S2 - S1^2/n cancels
    parts = rewards.split([2, 1, 3])

    def moments(r):
        return torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64), r.sum(), (r * r).sum()])

    for i, part in enumerate(parts):
        others = sum(moments(p) for j, p in enumerate(parts) if j != i)
        calls = []

        def all_reduce(t, others=others, calls=calls):
            calls.append(t.shape)
            return t + others

        std = global_reward_std(part, ddof, all_reduce)
        assert calls == [torch.Size([3])]  # one collective of three numbers
        torch.testing.assert_close(std, rewards.std(correction=ddof), rtol=1e-10, atol=0)
        adv = group_advantages(part, "global", adv_clip=100.0, ddof=ddof, all_reduce=all_reduce)
        torch.testing.assert_close(adv, group_advantages(rewards, "global", adv_clip=100.0, ddof=ddof)[
            sum(len(p) for p in parts[:i]) : sum(len(p) for p in parts[: i + 1])], rtol=1e-10, atol=0)
    torch.testing.assert_close(global_reward_std(rewards, ddof), rewards.std(correction=ddof), rtol=1e-10, atol=0)


def test_group_of_one_is_refused():
    with pytest.raises(ValueError, match="K >= 2"):
        group_advantages(torch.zeros(4, 1))


def _record(gen, kind="sde", k=2):
    times = flow_match_sigmas(8)
    z, v = torch.randn(3, 4, 2, 2, generator=gen, dtype=torch.float64), torch.randn(3, 4, 2, 2, generator=gen, dtype=torch.float64)
    dist = step_distribution(z, v, times[k], times[k + 1], kind, 0.7)
    z_next = sample_step(dist, torch.randn(3, 4, 2, 2, generator=gen, dtype=torch.float64))
    adv = torch.randn(3, generator=gen, dtype=torch.float64)
    return v, StepRecord(z, z_next, float(times[k]), float(times[k + 1]), dist.log_prob(z_next), adv)


def test_ratio_is_one_at_old_velocity_and_loss_is_minus_advantage(rng_seed):
    v, rec = _record(torch.Generator().manual_seed(rng_seed))
    loss, stats = step_loss(v, rec)
    torch.testing.assert_close(stats.ratio, torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(loss, -rec.advantage)


def test_clipped_surrogate_and_kl_gradients(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    v, rec = _record(gen)
    rec.ref_velocity = v + 0.05 * torch.randn(v.shape, generator=gen, dtype=torch.float64)
    v_new = (v + 0.3 * torch.randn(v.shape, generator=gen, dtype=torch.float64)).requires_grad_()
    loss, stats = step_loss(v_new, rec, clip_range=0.2, kl_beta=0.5)
    # reference computation by hand
    dist = step_distribution(rec.z, v_new, rec.t, rec.t_next)
    ref = step_distribution(rec.z, rec.ref_velocity, rec.t, rec.t_next)
    ratio = torch.exp(dist.log_prob(rec.z_next) - rec.old_log_prob)
    pg = torch.maximum(-rec.advantage * ratio, -rec.advantage * ratio.clamp(0.8, 1.2))
    sigma = 0.7 * (rec.t / (1 - rec.t)) ** 0.5  # Flow-GRPO's KL divides by 2 sigma_k^2, without the -dt
    kl = ((dist.mean - ref.mean) ** 2).mean(dim=(1, 2, 3)) / (2 * sigma**2)
    torch.testing.assert_close(loss, pg + 0.5 * kl)
    exact_loss, _ = step_loss(v_new, rec, clip_range=0.2, kl_beta=0.5, kl_convention="exact")  # the true KL
    torch.testing.assert_close(exact_loss, pg + 0.5 * kl * sigma**2 / dist.std**2)
    torch.testing.assert_close(stats.clipped, ((ratio - 1).abs() > 0.2).double())
    assert (kl > 0).all()
    # clipped samples (in the flat direction) have zero policy-gradient
    (g,) = torch.autograd.grad(pg.sum(), v_new)
    flat = ((ratio > 1.2) & (rec.advantage > 0)) | ((ratio < 0.8) & (rec.advantage < 0))
    for i in torch.nonzero(flat).flatten():
        assert g[i].abs().max() == 0


def test_kl_needs_reference():
    v, rec = _record(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="reference velocity"):
        step_loss(v, rec, kl_beta=0.1)
