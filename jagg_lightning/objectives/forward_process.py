"""The forward-process objectives' shared update (DiffusionNFT, AWM): a flow-matching loss on the rollout's clean
samples, no log-probs.

One training step: an ODE rollout (every step "ode", by ``sampling.ode_solver``: Euler or DPM-Solver++(2M); under
theta_old where the objective keeps one), decoded and scored; group advantages (the ``grpo`` section's settings);
then ``grpo.inner_epochs`` passes over shuffled micro-batches of ``grpo.train_batch_size``, one optimizer step per
update (``grpo.micro_batches_per_update``). For each update K noise levels t_1 > .. > t_K are drawn
(:func:`noise_levels`, from (seed, step, epoch, update): the same on every process) and each sample i gets its noise
eps (one per level, or one for all with ``objective.shared_noise``; from its own generator: the same whatever the
layout), so the points are

    z_ik = (1 - t_k) x0_i + t_k eps_ik,

and the update minimises (1 / (n K)) sum_i sum_k l(v_theta(z_ik, t_k), point ik) over its n samples, l the
objective's :meth:`ForwardProcessObjective.point_loss`. The K levels of a micro-batch go through the JAGG engine
(:func:`~jagg_lightning.method.jagg.accumulate_gradients`) as ONE window of K "steps": exact (a forward and a backward per
level) by default, or routed with ``objective.jagg`` -- with one eps per sample the K points lie on the chord
z_k = (1 - alpha_k) z_1 + alpha_k z_K, alpha_k = (t_1 - t_k) / (t_1 - t_K), so the Jacobian is interpolated between
the two extreme levels and the K upstream gradients fold into two: two grad forwards, K - 2 no-grad forwards, ONE
backward. Plain torch: no Lightning here.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from jagg_lightning.method.grpo import StepLossStats
from jagg_lightning.method.jagg import Window, WindowRecord, accumulate_gradients, plan_windows
from jagg_lightning.objectives.base import Objective
from jagg_lightning.training.rollout import sample_generators, sample_seed
from jagg_lightning.training.update import StepReport, Updater, UpdateHooks, shuffled_updates
from jagg_lightning.utils.batching import batch_slice
from jagg_lightning.utils.sharding import full_tensor, shard_like, values_swapped
from jagg_lightning.utils.timing import CLOCK

_LEVEL_STREAM, _NOISE_STREAM = -6, -7  # sample_seed streams of the noise levels and the per-sample noise


@dataclass
class MatchingPoint:
    """One noise level t of a micro-batch's B samples: clean x0, noise eps, z = (1 - t) x0 + t eps [B, ...], the
    advantages [B], theta_old's velocity at z (None: theta_old = theta, so v.detach()) and the reference's (None: no
    KL)."""

    x0: Tensor
    eps: Tensor
    t: Tensor  # a 0-d tensor
    z: Tensor
    advantages: Tensor
    v_old: Tensor | None = None
    v_ref: Tensor | None = None
    groups: Tensor | None = None  # [B] each sample's group (its prompt's row in the step: rollout row // group size)


def per_sample_mean(x: Tensor) -> Tensor:
    return x.flatten(1).mean(1)


def point_stats(policy_loss: Tensor, kl: Tensor) -> StepLossStats:
    """The logged statistics of a forward-process point (no ratio: 1, nothing clipped)."""
    zeros = torch.zeros_like(policy_loss)
    return StepLossStats(policy_loss.detach(), kl.detach(), torch.ones_like(policy_loss), zeros, zeros)


class ForwardProcessObjective(Objective):
    """An objective whose loss is a sum over points of the forward process of each rollout sample."""

    default_kl_beta: ClassVar[float] = 0.0
    routes_sde_windows: ClassVar[bool] = False  # its windows are noise levels, not the rollout's timesteps
    keeps_old_policy: ClassVar[bool] = False  # whether the loss reads theta_old's velocity
    needs_reference: ClassVar[bool] = False  # whether the loss reads the reference velocity even with kl_beta 0

    @property
    def kl_beta(self) -> float:
        return self.default_kl_beta if self.config.kl_beta is None else self.config.kl_beta

    def point_loss(self, v: Tensor, point: MatchingPoint) -> tuple[Tensor, StepLossStats]:
        """The per-sample loss [B] at one point, and its statistics."""
        raise NotImplementedError

    def kl_term(self, v: Tensor, point: MatchingPoint) -> Tensor:
        """kl_beta * mean (v - v_ref)^2 per sample (zeros without a reference)."""
        if point.v_ref is None:
            return torch.zeros(v.shape[0], dtype=v.dtype, device=v.device)
        return per_sample_mean((v - point.v_ref.to(v.dtype)) ** 2)

    def old_policy_decay(self, optimizer_steps: int) -> float | None:
        """theta_old <- d theta_old + (1 - d) theta after a training step that ends at ``optimizer_steps`` (None: no
        theta_old kept)."""
        return None

    def rollout_with_old(self, step: int) -> bool:
        """Whether training step ``step``'s rollout samples theta_old (when one is kept) rather than theta."""
        return True

    def level_schedule(self, times: Tensor) -> Tensor:
        """The schedule the "schedule" levels are drawn from (all of the rollout's times by default)."""
        return times

    def check(self, sampling, grpo, jagg) -> None:
        self.config.check_sections(sampling.num_steps)

    def updater(self, policy, sampling, grpo, jagg, memory, sampler) -> ForwardProcessUpdater:
        return ForwardProcessUpdater(policy, sampling, grpo, jagg, memory, sampler, self)


def noise_levels(kind: str, count: int, schedule: Tensor, shift: float, generator: torch.Generator,
                 index_range: tuple[int, int] | None = None) -> Tensor:
    """K noise levels in decreasing order (float64 [K]): ``count`` distinct times t_0 .. t_{S-1} of the rollout's
    ``schedule`` ("schedule"); one time from each of ``count`` consecutive strata of the schedule indices
    ``index_range`` [first, last] (null: [1, S - 1]) cut as evenly as possible, the first strata one index longer
    where they do not divide ("stratified": the AWM code's draw, e.g. 6 strata over indices 1..11 of a 14-step
    schedule, never t = 1); or drawn from U(0, 1) ("uniform") or sigmoid(N(0, 1)) ("logit_normal") and shifted,
    t <- s t / (1 + (s - 1) t)."""
    if kind == "schedule":
        pick = torch.randperm(len(schedule) - 1, generator=generator)[:count]
        t = schedule.double()[pick]
    elif kind == "stratified":
        first, last = index_range if index_range is not None else (1, len(schedule) - 2)
        strata = torch.arange(first, last + 1).tensor_split(count)
        pick = torch.stack([s[torch.randint(len(s), (1,), generator=generator)][0] for s in strata])
        t = schedule.double()[pick]
    else:
        u = torch.rand(count, generator=generator, dtype=torch.float64)
        if kind == "logit_normal":
            u = torch.sigmoid(torch.randn(count, generator=generator, dtype=torch.float64))
        t = shift * u / (1 + (shift - 1) * u)
    return t.sort(descending=True).values


class OldPolicy:
    """theta_old: a copy of the trainable weights, soft-updated after each training step (DiffusionNFT's "old"
    adapter). ``matches`` is True while it equals theta bit for bit (then no swap, no forward of its own).
    ``networks``: the modules holding ``params`` (under FSDP2 resharded around a swap, ``sharding.values_swapped``)."""

    def __init__(self, params: list[torch.nn.Parameter], networks=()):
        self.params, self.networks = params, list(networks)
        self.shadow = [p.detach().clone() for p in params]
        self.matches = True

    @torch.no_grad()
    def soft_update(self, decay: float) -> None:
        for s, p in zip(self.shadow, self.params):
            s.mul_(decay).add_(p.detach(), alpha=1.0 - decay) if decay > 0 else s.copy_(p.detach())
        self.matches = decay == 0

    def applied(self):
        """Inside the block the live parameters hold theta_old (a no-op while they match)."""
        return nullcontext() if self.matches else values_swapped(self.params, self.shadow, self.networks)


class ForwardProcessUpdater(Updater):
    """:meth:`step` for a :class:`ForwardProcessObjective` (the module docstring)."""

    def __init__(self, policy, sampling, grpo, jagg, memory, sampler, objective: ForwardProcessObjective):
        super().__init__(policy, sampling, grpo, jagg, memory, sampler)
        self.objective, self.config = objective, objective.config
        self.old: OldPolicy | None = None  # made at the first step (after any sharding) from theta
        self._old_state: list[Tensor] | None = None  # a checkpoint's theta_old, loaded at the first step
        self._old_matches = False

    # ------------------------------------------------------------------ theta_old and its checkpoint state
    def old_policy(self) -> OldPolicy | None:
        if not self.objective.keeps_old_policy:
            return None
        if self.old is None:
            self.old = OldPolicy(list(self.policy.lora_parameters()), self.policy.trained_networks().values())
            if self._old_state is not None:
                for s, full in zip(self.old.shadow, self._old_state):
                    s.copy_(shard_like(full.to(s.device), s))
                self.old.matches = self._old_matches
        return self.old

    def objective_state(self) -> dict:
        """theta_old (whole tensors: under FSDP2 every rank calls this) and whether it equals theta."""
        if self.old is None:
            return {} if self._old_state is None else {"old_policy": self._old_state, "old_matches": self._old_matches}
        return {"old_policy": [full_tensor(s).clone() for s in self.old.shadow], "old_matches": self.old.matches}

    def load_objective_state(self, state: dict) -> None:
        if "old_policy" in state:
            self._old_state, self.old = [t.clone() for t in state["old_policy"]], None
            self._old_matches = bool(state.get("old_matches", False))

    # ------------------------------------------------------------------ the step
    def step(self, prompts: list[str], indices: list[int], step: int, plan, reward, hooks: UpdateHooks) -> StepReport:
        cond = self.sampler.encode(prompts)
        old = self.old_policy()
        sample_prompts = [p for p in prompts for _ in range(self.sampling.group_size)]
        report = StepReport(cond)
        self.guard.start_rollout(indices, self.sampler.device)
        kinds = ["ode"] * self.sampling.num_steps
        # the rollout samples theta_old (DGPO: only from a given step on)
        with old.applied() if old is not None and self.objective.rollout_with_old(step) else nullcontext():
            rollout = self.sampler.rollout(cond, indices, step, kinds)
            for index, scored in enumerate(self.sampler.scored(rollout, reward, sample_prompts, None)):
                hooks.safe_point(f"rollout micro-batch {index + 1} (sampled and scored)")
                report.add_scored(scored)
                self.guard.check_rollout(scored.rows, scored.sampled.final)
                self.guard.check_rewards(scored.rows, scored.rewards, scored.components)
        hooks.safe_point("the rollout's end, before the update")
        advantages = report.add_advantages(*self.reward_advantages(report.rewards, report.components, reward,
                                                                   hooks.collectives))
        self.guard.check_advantages(slice(None), advantages)
        updates = self.update_points(report, advantages, indices, step, hooks, old)
        if old is not None:
            old.soft_update(self.objective.old_policy_decay(step + updates))
        return report

    def update_points(self, report: StepReport, advantages: Tensor, indices: list[int], step: int,
                      hooks: UpdateHooks, old: OldPolicy | None) -> int:
        """``inner_epochs`` passes over shuffled micro-batches, one optimizer step per update; returns the updates."""
        x0, cond, num = report.trajectory.latents[-1], report.cond, advantages.shape[0]
        K = self.config.levels_for(self.sampling.num_steps)
        shuffle = torch.Generator().manual_seed(sample_seed(self.sampling.seed, step, -1))
        updates = 0
        for epoch in range(self.grpo.inner_epochs):
            eps = self.noise(indices, step, epoch, K, x0)
            epoch_updates = self.epoch_updates(num, shuffle)
            for group in epoch_updates:
                update_size = sum(len(m) for m in group)
                gen = torch.Generator().manual_seed(sample_seed(self.sampling.seed, step, _LEVEL_STREAM, epoch, updates))
                times = noise_levels(self.config.levels, K, self.objective.level_schedule(self.sampler.times.cpu()),
                                     self.config.level_shift, gen, self.config.level_indices(self.sampling.num_steps))
                with hooks.collectives.local_backward():
                    for index in group:
                        self.guard.train(index)
                        with CLOCK.phase("update/forward"):  # its backwards: update/backward (hooks.backward)
                            report.records += self.backward_points(
                                x0[index], eps[index], advantages[index], batch_slice(cond, index), times,
                                update_size, report, hooks.backward, index, None if old is None or old.matches else old)
                hooks.optimizer_step()
                updates += 1
                if old is not None:
                    old.matches = False  # theta moved on
            report.micro_batches += sum(len(group) for group in epoch_updates)
        report.exact_backwards = K * report.micro_batches
        report.windows = self.level_windows(K)  # train/routed_frac and RoutingStats read these, not the GRPO plan's
        return updates

    def epoch_updates(self, num: int, shuffle: torch.Generator) -> list[list[Tensor]]:
        """One inner epoch's updates: lists of micro-batches (row indices of the rollout)."""
        return shuffled_updates(num, self.grpo, shuffle, self.sampler.device)

    def noise(self, indices: list[int], step: int, epoch: int, K: int, like: Tensor) -> Tensor:
        """eps [N, K or 1, ...]: each sample's own generator (seed, step, prompt index, sample index), per epoch."""
        seed = sample_seed(self.sampling.seed, _NOISE_STREAM, epoch)
        draws = 1 if self.config.shared_noise else K
        gens = sample_generators(seed, step, indices, self.sampling.group_size)
        eps = torch.stack([torch.randn(draws, *like.shape[1:], generator=g, dtype=like.dtype) for g in gens])
        return eps.to(like.device)

    def backward_points(self, x0: Tensor, eps: Tensor, advantages: Tensor, cond, times: Tensor, update_size: int,
                        report: StepReport, backward, samples: Tensor, old: OldPolicy | None) -> list[WindowRecord]:
        """The K points of ``x0``'s samples through the engine: d/dtheta of (n / (update_size K)) mean_i sum_k l_ik,
        into ``.grad`` (one record per level window). ``old``: theta_old when it differs from theta (then one no-grad
        forward per level)."""
        K = times.shape[0]
        t = times.to(x0.dtype).to(x0.device)
        shape = (K, *[1] * x0.dim())
        noise = eps.transpose(0, 1).expand(K, *eps.shape[:1], *eps.shape[2:])  # [K, B, ...]
        latents = (1 - t.view(shape)) * x0.unsqueeze(0) + t.view(shape) * noise
        forwards, old_v, ref_v = 0, None, None
        if old is not None:
            with torch.no_grad(), old.applied():
                old_v = [self.sampler.velocity(latents[k], t[k].expand(x0.shape[0]), cond) for k in range(K)]
            forwards += K
        if self.objective.kl_beta > 0 or self.objective.needs_reference:
            with torch.no_grad():
                ref_v = [self.sampler.reference_velocity(latents[k], t[k].expand(x0.shape[0]), cond) for k in range(K)]
            report.reference_forwards += K
        scale = x0.shape[0] / (update_size * K)
        groups = samples // self.sampling.group_size

        def loss_of_point(k: int, v: Tensor) -> Tensor:
            point = MatchingPoint(x0, noise[k], t[k], latents[k], advantages,
                                  None if old_v is None else old_v[k], None if ref_v is None else ref_v[k], groups)
            loss, stats = self.objective.point_loss(v.to(x0.dtype), point)
            report.stats.append((k, stats))
            self.guard.check_loss(samples, loss)
            return loss.mean() * scale

        records = accumulate_gradients(self.sampler.velocity, latents, t, cond, loss_of_point, self.level_windows(K),
                                       backward=backward)
        records[0].nograd_forwards += forwards
        return records

    def level_windows(self, K: int) -> list[Window]:
        """The K levels (in decreasing t) as engine windows: one exact window; with ``objective.jagg`` routed windows of
        ``objective.jagg_window`` consecutive levels (null: all K), a shorter tail exact."""
        if not self.config.jagg or K <= 2:
            return [Window(tuple(range(K)))]
        size = min(self.config.jagg_window or K, K)
        windows = plan_windows(list(range(K)), size)
        for w in windows:
            w.routed = len(w.steps) == size
        return windows

    def check_windows(self, batch, plan, params, max_samples=None) -> list:
        return []  # the GRPO windows' check; the forward-process points have no SDE windows
