"""The rollout's ODE tail (``jagg_lightning.method.ode_solvers``): DPM-Solver++(2M) in its flow-matching form equals diffusers'
``DPMSolverMultistepScheduler`` (float64, every state), its first-order steps are the Euler steps bit for bit, it is
more accurate than Euler at equal evaluations against a fine solve of a smooth nonlinear flow, and the tail's grid
keeps the trained steps' times and the schedule's own spacing."""

import math
import random

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler

from jagg_lightning.method.ode_solvers import ODEStepper, ode_tail, tail_times
from jagg_lightning.method.sde import flow_match_sigmas, step_distribution

D = 6  # latent elements per sample


def solve(velocity, z, times, solver):
    """The rollout's ODE steps (``sde.step_distribution``'s Euler mean, then the stepper) on ``times``; every state."""
    stepper, states = ODEStepper(solver, times), [z]
    for k in range(len(times) - 1):
        v = velocity(z, times[k])
        z = stepper.step(k, z, v, step_distribution(z, v, times[k], times[k + 1], "ode", 0.0).mean)
        states.append(z)
    return states


def random_field(kind, gen):
    """A random velocity field v(z, t), float64: affine in z with t-dependent coefficients, or a tanh network."""
    a0, a1 = (torch.randn(D, D, generator=gen, dtype=torch.float64) / D**0.5 for _ in range(2))
    b = torch.randn(D, generator=gen, dtype=torch.float64)
    w1 = torch.randn(16, D, generator=gen, dtype=torch.float64)
    w2 = torch.randn(D, 16, generator=gen, dtype=torch.float64)
    c = torch.randn(16, generator=gen, dtype=torch.float64)
    if kind == "linear":
        return lambda z, t: z @ (a0 + float(t) * a1).T + math.cos(3 * float(t)) * b
    return lambda z, t: torch.tanh(z @ w1.T + float(t) * c) @ w2.T / 4 + float(t) * z


def random_tail(rng):
    """A shifted flow-match schedule of S steps, T trained steps and a tail of n >= 3 steps (second order inside)."""
    S = rng.randint(8, 20)
    T = rng.randint(1, S - 3)
    n = rng.randint(3, S - T)
    times = flow_match_sigmas(S, rng.uniform(1.0, 4.0)).double()
    return tail_times(times, T, n)[T:], n


def diffusers_scheduler(tail):
    """diffusers' DPM-Solver++(2M) for flow matching on our tail: its sigmas ARE the tail's times (t_T .. 0)."""
    scheduler = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                            algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint",
                                            lower_order_final=True, final_sigmas_type="zero")
    scheduler.set_timesteps(len(tail) - 1)  # n steps (its own sigmas are replaced by ours below)
    scheduler.sigmas = tail.clone()
    return scheduler


def diffusers_float64(scheduler, velocity, z):
    """``scheduler.step``'s solver, step by step, in float64: ``step`` itself casts the sample to float32, so its order
    choice is replayed here (first order at the first step and at the last, into sigma 0: ``final_sigmas_type`` zero
    forces ``lower_order_final``; second order between) with the scheduler's own update formulas."""
    n, outputs, states = len(scheduler.timesteps), [None, None], [z]
    for i in range(n):
        scheduler._step_index = i  # what step() keeps (the formulas read self.step_index)
        x0 = scheduler.convert_model_output(velocity(z, scheduler.sigmas[i]), sample=z)
        outputs = [outputs[1], x0]
        if i == 0 or i == n - 1:
            z = scheduler.dpm_solver_first_order_update(x0, sample=z)
        else:
            z = scheduler.multistep_dpm_solver_second_order_update(outputs, sample=z)
        states.append(z)
    return states


@pytest.mark.parametrize("field", ["linear", "nonlinear"])
def test_dpmpp_2m_equals_diffusers_dpm_solver_multistep(field, rng_seed):
    rng, gen = random.Random(rng_seed), torch.Generator().manual_seed(rng_seed)
    velocity = random_field(field, gen)
    for _ in range(3):
        tail, n = random_tail(rng)
        z = torch.randn(5, D, generator=gen, dtype=torch.float64)
        ours = solve(velocity, z, tail, "dpmpp_2m")
        theirs = diffusers_float64(diffusers_scheduler(tail), velocity, z)
        for k, (a, b) in enumerate(zip(ours, theirs)):
            assert float((a - b).abs().max() / b.abs().max()) < 1e-12, (k, n)
        # diffusers' own step() (its sample cast to float32 inside): the same order choice, to float32 precision
        scheduler, zs = diffusers_scheduler(tail), z
        scheduler.set_begin_index(0)
        for i in range(n):
            zs = scheduler.step(velocity(zs, scheduler.sigmas[i]), scheduler.timesteps[i], zs).prev_sample
        euler = solve(velocity, z, tail, "euler")[-1]
        scale = float(ours[-1].abs().max())
        assert float((zs - ours[-1]).abs().max()) < 1e-5 * scale
        assert float((euler - ours[-1]).abs().max()) > 1e-3 * scale  # ... which tells the two solvers apart


def test_first_order_steps_are_the_euler_steps_bit_for_bit(rng_seed):
    """A tail of 1 or 2 steps is Euler; in a longer one the first step and the step into t = 0 are Euler's from the
    same state, bit for bit (and float32 runs in float32)."""
    rng, gen = random.Random(rng_seed), torch.Generator().manual_seed(rng_seed)
    velocity = random_field("nonlinear", gen)
    times = flow_match_sigmas(rng.randint(8, 14), 3.0).double()
    for n in (1, 2):
        tail = tail_times(times, 2, n)[2:]
        z = torch.randn(4, D, generator=gen, dtype=torch.float64)
        two_m, euler = solve(velocity, z, tail, "dpmpp_2m"), solve(velocity, z, tail, "euler")
        assert all(torch.equal(a, b) for a, b in zip(two_m, euler))
    tail = tail_times(times, 2, 4)[2:]
    z = torch.randn(4, D, generator=gen, dtype=torch.float64)
    states = solve(velocity, z, tail, "dpmpp_2m")
    for k in (0, 3):
        v = velocity(states[k], tail[k])
        assert torch.equal(states[k + 1], states[k] + v * (tail[k + 1] - tail[k]))
    v32 = lambda z, t: velocity(z.double(), t).float()  # noqa: E731
    assert solve(v32, z.float(), tail.float(), "dpmpp_2m")[-1].dtype == torch.float32


def mixture_flow(gen, modes, spread):
    """The exact rectified-flow velocity of a Gaussian mixture (data x ~ sum_i w_i N(mu_i, spread^2 I)): a smooth
    nonlinear field, v(z, t) = (z - E[x | z_t = z]) / t, and a sampler of z_t from the forward process."""
    mu = torch.randn(modes, D, generator=gen, dtype=torch.float64)
    log_w = torch.log_softmax(torch.randn(modes, generator=gen, dtype=torch.float64), 0)

    def data_prediction(z, t):
        var = (1 - t) ** 2 * spread**2 + t**2
        diff = z[:, None, :] - (1 - t) * mu[None]
        resp = torch.softmax(log_w[None] - (diff**2).sum(-1) / (2 * var), -1)
        return (resp[..., None] * (mu[None] + (1 - t) * spread**2 / var * diff)).sum(1)

    def sample(n, t):
        idx = torch.multinomial(log_w.exp(), n, replacement=True, generator=gen)
        x = mu[idx] + spread * torch.randn(n, D, generator=gen, dtype=torch.float64)
        return (1 - t) * x + t * torch.randn(n, D, generator=gen, dtype=torch.float64)

    return (lambda z, t: (z - data_prediction(z, float(t))) / float(t)), data_prediction, sample


def fine_solve(data_prediction, z, t0, steps=200, t_end=1e-6):
    """The reference: classical RK4 in s = log t (dz/ds = t v = z - x_hat(z, t), smooth down to t = 0) from t0 to
    t_end, then x_hat there (an O(t_end) step)."""
    s = torch.linspace(torch.log(torch.tensor(t0)), torch.log(torch.tensor(t_end)), steps + 1, dtype=torch.float64)
    f = lambda z, s: z - data_prediction(z, float(torch.exp(s)))  # noqa: E731
    for a, b in zip(s[:-1], s[1:]):
        h = b - a
        k1 = f(z, a)
        k2 = f(z + h / 2 * k1, a + h / 2)
        k3 = f(z + h / 2 * k2, a + h / 2)
        k4 = f(z + h * k3, b)
        z = z + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return data_prediction(z, t_end)


def test_dpmpp_2m_is_more_accurate_than_euler_at_equal_evaluations(rng_seed):
    """On random Gaussian-mixture flows, tails of n = 3 .. (S - T) // 2 steps of random shifted schedules (the regime
    the option is for: fewer steps than the schedule's tail, whose last interval into its near-zero last time is
    not a second-order step then), from z_T of the forward process: DPM-Solver++(2M) ends nearer the fine solve than
    Euler with as many velocity evaluations, in every case, and by a clear margin on average."""
    rng, gen = random.Random(rng_seed), torch.Generator().manual_seed(rng_seed)
    ratios = []
    for _ in range(4):
        S = rng.randint(10, 20)
        T = rng.randint(1, S - 6)
        n = rng.randint(3, (S - T) // 2)
        times = flow_match_sigmas(S, rng.uniform(1.0, 3.0)).double()
        velocity, data_prediction, sample = mixture_flow(gen, rng.randint(1, 8), rng.uniform(0.5, 1.0))
        z = sample(16, float(times[T]))
        reference = fine_solve(data_prediction, z, float(times[T]))
        tail = tail_times(times, T, n)[T:]
        error = {s: float((solve(velocity, z, tail, s)[-1] - reference).norm() / reference.norm())
                 for s in ("euler", "dpmpp_2m")}
        assert error["dpmpp_2m"] < error["euler"], (S, T, n, error)
        ratios.append(error["dpmpp_2m"] / error["euler"])
    assert sum(ratios) / len(ratios) < 0.85, ratios


def test_tail_grid_keeps_the_trained_times_and_the_schedule_spacing(rng_seed):
    rng = random.Random(rng_seed)
    S = rng.randint(6, 20)
    T = rng.randint(1, S - 1)
    times = flow_match_sigmas(S, rng.uniform(1.0, 4.0))
    assert torch.equal(tail_times(times, T, S - T), times)  # n = S - T: the schedule itself
    for n in range(1, S - T + 1):
        grid = tail_times(times, T, n)
        assert len(grid) == T + n + 1 and grid.dtype == times.dtype
        assert torch.equal(grid[: T + 1], times[: T + 1]) and grid[-1] == 0
        assert bool((grid[1:] < grid[:-1]).all())
        if (S - T) % n == 0:  # every (S - T) / n-th time of the schedule
            assert torch.equal(grid[T:], times[T :: (S - T) // n])
    kinds = ["sde"] * T + ["ode"] * (S - T)
    grid, tail_kinds = ode_tail(times, kinds, T, 1)
    assert tail_kinds == ["sde"] * T + ["ode"] and torch.equal(grid, tail_times(times, T, 1))
    assert ode_tail(times, kinds, T, None) == (times, kinds)
    with pytest.raises(ValueError, match="sampling.ode_steps"):
        ode_tail(times, ["sde"] * S, T, 1)
