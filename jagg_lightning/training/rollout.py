"""SDE rollouts that record everything GRPO and JAGG need, seeded per sample.

Each sample has its own ``torch.Generator`` seeded from (seed, global step, prompt index, sample
index); it draws the initial noise, then one step noise per sampling step, in order. A rollout is
therefore identical whatever the micro-batch size, the batch layout or the number of processes.

What a rollout trains is drawn from (seed, global step) alone, never from the rank, so every process
makes the same choice: the start of the SDE window (:func:`sde_window_start`, Flow-GRPO-Fast's random
start or MixGRPO's progressive shift) and the share of JAGG windows trained (:func:`choose_windows`,
DanceGRPO's ``timestep_fraction`` at window granularity).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from jagg_lightning.method.jagg import VelocityFn, Window, plan_windows
from jagg_lightning.method.ode_solvers import ODEStepper
from jagg_lightning.method.sde import STEP_KINDS, LogProbConvention, StepKind, sample_step, step_distribution
from jagg_lightning.utils.batching import batch_slice
from jagg_lightning.utils.dtypes import compute_dtype

if TYPE_CHECKING:
    from jagg_lightning.config import JAGGConfig, SamplingConfig


def sample_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (Python's hash() is salted per process)."""
    digest = hashlib.sha256("/".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def sample_generators(seed: int, step: int, prompt_indices: Sequence[int], group_size: int) -> list[torch.Generator]:
    """One CPU generator per sample, laid out prompt-major: [p0 s0, p0 s1, ..., p1 s0, ...]."""
    return [
        torch.Generator().manual_seed(sample_seed(seed, step, p, i)) for p in prompt_indices for i in range(group_size)
    ]


# stream tags of the per-rollout draws made from (seed, step) only; -1 is the update's shuffle
_WINDOW_START_STREAM = -2
_WINDOW_CHOICE_STREAM = -3


def sde_window_start(
    seed: int,
    step: int,
    window_size: int,
    window_range: Sequence[int],
    schedule: str = "random",
    shift_every: int = 25,
    stride: int = 1,
    rollout: int | None = None,
) -> int:
    """First step of the SDE window of the rollout at ``step``; the window is start .. start + size - 1.

    ``window_range`` = (lo, hi): the window lies inside steps lo .. hi - 1, so start is in
    [lo, hi - window_size].
    ``"random"``: start uniform over that range, drawn from (seed, step) (Flow-GRPO-Fast).
    ``"progressive"``: start = lo + stride * (rollout // shift_every), held at hi - window_size once it
    gets there (MixGRPO's sliding window, which moves every ``shift_every`` rollouts: its
    ``iters_per_group`` counts ``train_one_step`` calls). ``rollout``: the number of rollouts before
    this one (default ``step``: one optimizer step per rollout).
    """
    lo, hi = int(window_range[0]), int(window_range[1])
    last = hi - window_size
    if last < lo:
        raise ValueError(f"window range {tuple(window_range)} cannot hold a window of {window_size} steps")
    if schedule == "random":
        gen = torch.Generator().manual_seed(sample_seed(seed, step, _WINDOW_START_STREAM))
        return lo + int(torch.randint(last - lo + 1, (1,), generator=gen))
    if schedule == "progressive":
        return min(lo + stride * ((step if rollout is None else rollout) // shift_every), last)
    raise ValueError(f"schedule must be 'random' or 'progressive', got {schedule!r}")


def choose_windows(num_windows: int, fraction: float, seed: int, step: int) -> list[int]:
    """Indices (sorted) of the windows trained at ``step``: max(1, int(fraction * num_windows)) of them,
    drawn without replacement from (seed, step); all of them when fraction is 1."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    count = max(1, int(fraction * num_windows + 1e-9))
    if count >= num_windows:
        return list(range(num_windows))
    gen = torch.Generator().manual_seed(sample_seed(seed, step, _WINDOW_CHOICE_STREAM))
    return sorted(torch.randperm(num_windows, generator=gen)[:count].tolist())


def group_steps(sampling: SamplingConfig, step: int, prompt_indices: Sequence[int]) -> list[int]:
    """``sampling.sde_window_draw: group`` (Flash-GRPO's iso-temporal groups): each prompt's ONE trained step, uniform
    over the SDE window's range, drawn from (seed, step, prompt index) -- the same for all of its samples, whatever the
    batch layout or the number of processes."""
    lo, hi = sampling.sde_window_range
    return [lo + int(torch.randint(hi - lo, (1,), generator=torch.Generator().manual_seed(
        sample_seed(sampling.seed, step, _WINDOW_START_STREAM, p)))) for p in prompt_indices]


def step_kinds_at(sampling: SamplingConfig, step: int, rollout: int | None = None) -> tuple[list[str], list[int]]:
    """(kind of every sampling step, the stochastic steps) of the rollout at ``step``: the SDE window drawn or
    slid by :func:`sde_window_start`, else the first ``num_trained`` steps; ``rollout``: how many rollouts came
    before (the progressive SDE window counts them; default ``step``)."""
    s = sampling
    if s.sde_window_size is None:
        stochastic = list(range(s.num_trained))
        after = "ode" if s.ode_after_trained else s.step_kind
        kinds = [s.step_kind if k < s.num_trained else after for k in range(s.num_steps)]
    elif s.sde_window_draw == "group":  # every step ODE but each row's own (group_steps, the rollout's row_steps)
        return ["ode"] * s.num_steps, list(range(*s.sde_window_range))
    else:
        start = sde_window_start(s.seed, step, s.sde_window_size, s.sde_window_range, s.sde_window_schedule,
                                 s.sde_window_shift_every, s.sde_window_stride, rollout)
        stochastic = list(range(start, start + s.sde_window_size))
        kinds = [s.step_kind if k in stochastic else "ode" for k in range(s.num_steps)]
    return kinds, stochastic


@dataclass
class RolloutPlan:
    """What one rollout samples and trains, drawn from (seed, global step) only: the same on every process."""

    step_kinds: list[str]  # per sampling step: "sde" / "cps" inside the stochastic steps, "ode" elsewhere
    stochastic_steps: list[int]  # the SDE window (or the first num_trained steps)
    windows: list[Window] = field(default_factory=list)  # the JAGG windows trained (after window_fraction)
    per_sample_steps: int | None = None  # steps each sample trains, when not every trained step (group draws)

    @property
    def trained_steps(self) -> list[int]:
        return sorted({k for w in self.windows for k in w.steps})

    @property
    def steps_per_sample(self) -> int:
        """Trained steps per sample: the loss's mean runs over them."""
        return self.per_sample_steps or len(self.trained_steps)


def plan_rollout(sampling: SamplingConfig, jagg: JAGGConfig, step: int, rollout: int | None = None,
                 breaks: Sequence[int] = ()) -> RolloutPlan:
    """Step kinds, SDE window and trained JAGG windows of the rollout at ``step`` (seeded, rank-free);
    ``rollout``: how many rollouts came before (the progressive SDE window counts them; default step);
    ``breaks``: steps where the policy switches networks (``Policy.expert_starts``), never straddled."""
    kinds, stochastic = step_kinds_at(sampling, step, rollout)
    # one trained step (Flash-GRPO, an SDE window of 1): its own exact window, whatever jagg.window_size; drawn per
    # group: one window per step a group may draw (the update trains each sample at its own, Updater.step)
    if sampling.sde_window_size == 1:
        windows = [Window((k,)) for k in stochastic]
        return RolloutPlan(kinds, stochastic, windows, per_sample_steps=1)
    windows = plan_windows(stochastic, jagg.window_size, jagg.chained, breaks)
    chosen = choose_windows(len(windows), jagg.window_fraction, sampling.seed, step)
    return RolloutPlan(kinds, stochastic, [windows[i] for i in chosen])


@dataclass
class Trajectory:
    """A batch of N trajectories over S sampling steps, step-major."""

    latents: Tensor  # [S + 1, N, ...]: z_0 (noise) .. z_S (clean)
    log_probs: Tensor  # [S, N]: log pi_old(z_{k+1} | z_k); 0 for ODE steps
    velocities: Tensor  # [S, N, ...]: v_old(z_k, t_k) as used by the sampler (after guidance)
    times: Tensor  # [S + 1]
    ref_velocities: Tensor | None = None  # [S, N, ...]: reference (adapter-off) velocity at reference_steps, else 0

    def select(self, index: Tensor | slice) -> Trajectory:
        ref = None if self.ref_velocities is None else self.ref_velocities[:, index]
        return Trajectory(self.latents[:, index], self.log_probs[:, index], self.velocities[:, index], self.times, ref)


@dataclass
class SampledMicroBatch:
    """One rollout micro-batch, as it ends: its ``rows`` of the step's ``trajectory`` (complete up to
    ``rows.stop``), the velocities kept WITH their autograd graphs for its first ``graph_rows`` samples (the fused
    mode: step k -> [graph_rows, ...]) and the reference (adapter-off) forwards it made."""

    rows: slice
    trajectory: Trajectory
    graphs: dict[int, Tensor] = field(default_factory=dict)
    graph_rows: int = 0
    reference_forwards: int = 0

    @property
    def part(self) -> Trajectory:
        """Its samples' trajectories (views: what is written into them is the step's)."""
        return self.trajectory.select(self.rows)

    @property
    def final(self) -> Tensor:
        """Its samples' final latents z_S."""
        return self.trajectory.latents[-1, self.rows]


@torch.no_grad()
def rollout_micro_batches(
    velocity_fn: VelocityFn,
    cond: Any,
    generators: Sequence[torch.Generator],
    latent_shape: Sequence[int],
    times: Tensor,
    step_kinds: Sequence[StepKind],
    noise_level: float,
    micro_batch_size: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    cps_log_prob: LogProbConvention = "squared_error",
    reference_fn: VelocityFn | None = None,
    reference_steps: Collection[int] = (),
    grad_steps: Collection[int] = (),
    grad_samples: int | None = None,
    ode_solver: str = "euler",
    row_steps: Sequence[int] | None = None,
    row_kind: StepKind = "sde",
) -> Iterator[SampledMicroBatch]:
    """Run len(generators) samples through the S = len(step_kinds) steps, micro-batch by micro-batch, yielding each
    micro-batch as it ends (the caller decodes and scores it, or updates on it, while the next one waits).

    The stored log-prob of a step is 0 when the step is deterministic (ODE, or CPS into t = 0): never NaN.
    ``reference_fn`` (e.g. the policy with its adapter off) is evaluated at ``reference_steps`` on the
    same z and t, into ``ref_velocities``: the KL reference costs no second pass over the latents.
    At ``grad_steps`` the first ``grad_samples`` samples of each micro-batch (default: all) are run with
    grad; the micro-batch carries those velocities with their graphs (``graphs``); the sampler uses them detached.
    ODE steps move by ``ode_solver`` (:class:`~jagg_lightning.method.ode_solvers.ODEStepper`: "euler", or "dpmpp_2m" whose
    history starts afresh after each stochastic step); every step still draws its noise, in order.
    ``row_steps`` (per sample, Flash-GRPO's per-group draw; Euler ODE steps): sample i takes a ``row_kind`` step at
    step ``row_steps[i]`` instead of the step's kind (computed on those rows alone: element-wise, as on all rows).
    """
    num = len(generators)
    steps = len(step_kinds)
    if len(times) != steps + 1:
        raise ValueError(f"times must have {steps + 1} entries, got {len(times)}")
    dtype = compute_dtype(dtype)  # the SDE never runs in half precision
    latents = torch.empty(steps + 1, num, *latent_shape, dtype=dtype, device=device)
    velocities = torch.empty(steps, num, *latent_shape, dtype=dtype, device=device)
    log_probs = torch.zeros(steps, num, dtype=dtype, device=device)
    times = times.to(device=device, dtype=dtype)
    ode = ODEStepper(ode_solver, times)
    ref = None if reference_fn is None else torch.zeros_like(velocities)
    traj = Trajectory(latents, log_probs, velocities, times, ref)

    def noise(gens):
        return torch.stack([torch.randn(*latent_shape, generator=g, dtype=dtype) for g in gens]).to(device)

    def velocity(k: int, z: Tensor, cond_mb, mb: SampledMicroBatch) -> Tensor:
        t = times[k].expand(z.shape[0])
        if k not in grad_steps:
            return velocity_fn(z, t, cond_mb)
        n = mb.graph_rows
        with torch.enable_grad():
            v = velocity_fn(z[:n], t[:n], batch_slice(cond_mb, slice(0, n)))
        mb.graphs[k] = v
        if n == z.shape[0]:
            return v.detach()
        return torch.cat([v.detach(), velocity_fn(z[n:], t[n:], batch_slice(cond_mb, slice(n, None)))])

    for start in range(0, num, micro_batch_size):
        part = slice(start, min(start + micro_batch_size, num))
        size = part.stop - part.start
        mb = SampledMicroBatch(part, traj, graph_rows=size if grad_samples is None else min(grad_samples, size))
        gens, cond_mb = generators[part], batch_slice(cond, part)
        z = noise(gens)
        latents[0, part] = z
        ode.reset()
        for k, kind in enumerate(step_kinds):
            v = velocity(k, z, cond_mb, mb).to(dtype)
            if ref is not None and k in reference_steps:
                ref[k, part] = reference_fn(z, times[k].expand(z.shape[0]), cond_mb).to(dtype)
                mb.reference_forwards += 1
            dist = step_distribution(z, v, times[k], times[k + 1], kind, noise_level)
            eps = noise(gens)
            stochastic = STEP_KINDS[kind].stochastic
            z_in = z
            if stochastic:
                z = sample_step(dist, eps)
                ode.reset()
            else:
                z = ode.step(k, z, v, dist.mean)
            if stochastic:
                log_probs[k, part] = dist.log_prob(z, cps_log_prob)
            rows = [i - part.start for i in range(part.start, part.stop) if row_steps is not None and row_steps[i] == k]
            if rows:  # these rows' own stochastic step
                own = step_distribution(z_in[rows], v[rows], times[k], times[k + 1], row_kind, noise_level)
                z = z.clone()
                z[rows] = sample_step(own, eps[rows])
                log_probs[k, part.start + torch.tensor(rows)] = own.log_prob(z[rows], cps_log_prob)
            velocities[k, part] = v
            latents[k + 1, part] = z
        yield mb


def sample_trajectories(*args, **kwargs) -> Trajectory:
    """:func:`rollout_micro_batches` run to the end: the whole trajectory (evaluation's ODE samples, the checks)."""
    traj = None
    for mb in rollout_micro_batches(*args, **kwargs):
        traj = mb.trajectory
    return traj


@dataclass
class RolloutBatch:
    """What one training step's rollout produced, kept until the next step for diagnostics."""

    trajectory: Trajectory  # its ref_velocities: the KL reference the update used
    cond: tuple
    advantages: Tensor
