"""The training step's update: from the rollout's micro-batches to LoRA gradients and optimizer steps.

:meth:`Updater.step` drives both modes, top to bottom. The rollout yields its micro-batches, each scored as it is
sampled (:meth:`~jagg_lightning.training.sampler.Sampler.scored`). Fused (``jagg.fused_rollout``: theta = theta_old, the
rollout keeps the graphs of the steps that get a backward): each micro-batch, as it is scored, gets its advantages,
its routing, its KL reference completed and ONE backward. Unfused: the same over the finished rollout, then
``inner_epochs`` passes over shuffled micro-batches, one optimizer step per update (:meth:`Updater.update_rollout`).
Everything the module logs comes back in the :class:`StepReport`.

The :class:`Updater` is handed the policy, the config sections and the :class:`~jagg_lightning.training.sampler.Sampler`;
what belongs to the Lightning side (the backward call, the optimizer step, the collectives) comes in per
training step as :class:`UpdateHooks`. Plain torch, no Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from jagg_lightning.distributed.collectives import Collectives
from jagg_lightning.faults.nonfinite import NonFiniteGuard
from jagg_lightning.method.estimators import build_estimator
from jagg_lightning.method.grpo import StepRecord, combined_advantages, group_advantages, rectification_weights, step_loss
from jagg_lightning.method.jagg import (
    Window, WindowGradientCheck, WindowRecord, accumulate_gradients, alphas, check_window_gradients,
)
from jagg_lightning.method.routing import route_windows, routing_score
from jagg_lightning.rewards import Reward, component_weights
from jagg_lightning.training.passes import fused_graph_steps, fused_samples, pass_plan, reference_steps
from jagg_lightning.training.rollout import RolloutBatch, RolloutPlan, SampledMicroBatch, Trajectory, group_steps, sample_seed
from jagg_lightning.training.sampler import Sampler, ScoredMicroBatch
from jagg_lightning.utils.batching import batch_slice
from jagg_lightning.utils.timing import CLOCK

_ROUTING_STREAM, _CONTROL_STREAM = -4, -5  # sample_seed streams of the random routing scores and the control draws


def shuffled_updates(num: int, grpo, shuffle: torch.Generator, device) -> list[list[Tensor]]:
    """One inner epoch's updates: the rollout's ``num`` rows shuffled by ``shuffle`` into micro-batches of
    ``grpo.train_batch_size`` rows, ``grpo.micro_batches_per_update`` of them per update (null: all). Each micro-batch
    keeps the rollout's row order: a matmul kernel may round a row differently by its position in the batch (AVX-512
    blocks rows), so on the first update the forwards see the rollout's rows where they were and the ratio is 1 bit
    for bit."""
    perm = torch.randperm(num, generator=shuffle).to(device)
    micro = [m.sort().values for m in perm.split(grpo.train_batch_size)]
    per_update = grpo.micro_batches_per_update or len(micro)
    return [micro[start : start + per_update] for start in range(0, len(micro), per_update)]


@dataclass
class UpdateHooks:
    """What the update needs from the training loop: the backward call (Lightning's ``manual_backward``), the
    optimizer step that follows an update's backward passes, the collectives of the processes, and the safe point
    (``safe_point(where)``: it may raise to abandon the step; called on every process alike, only before the step's
    first optimizer step, so an abandoned step has changed nothing that a checkpoint holds)."""

    backward: Callable[[Tensor], None] = Tensor.backward
    optimizer_step: Callable[[], None] = lambda: None
    collectives: Collectives = field(default_factory=Collectives)
    safe_point: Callable[[str], None] = lambda where: None


@dataclass
class StepReport:
    """What one training step's rollout and update produced: the module logs it and keeps it for callbacks. Filled
    in as the step runs: :meth:`add_scored` per rollout micro-batch, :meth:`add_advantages` per advantage batch."""

    cond: tuple
    trajectory: Trajectory | None = None
    records: list[WindowRecord] = field(default_factory=list)  # per window and engine pass
    stats: list = field(default_factory=list)  # (k, StepLossStats) of the updates after the first
    first_update_stats: list = field(default_factory=list)  # (k, StepLossStats) of the first update (theta = theta_old)
    micro_batches: int = 0  # training micro-batches over all updates (exact GRPO's backward count per step)
    skipped_samples: int = 0  # zero-advantage samples given no pass
    reference_forwards: int = 0  # adapter-off forwards of the step (rollout and completed reference)
    exact_backwards: int = 0  # backwards the objective makes without JAGG (GRPO: trained steps x micro-batches)
    windows: list | None = None  # the windows the update used when not the plan's (forward-process: noise levels)
    _rewards: list[Tensor] = field(default_factory=list)
    _components: list[dict[str, Tensor]] = field(default_factory=list)
    _advantages: list[Tensor] = field(default_factory=list)
    _parts: list[dict[str, Tensor]] = field(default_factory=list)

    def add_scored(self, scored: ScoredMicroBatch) -> None:
        self.trajectory = scored.trajectory
        self.reference_forwards += scored.sampled.reference_forwards
        self._rewards.append(scored.rewards)
        self._components.append(scored.components)

    def add_advantages(self, advantages: Tensor, parts: dict[str, Tensor]) -> Tensor:
        self._advantages.append(advantages)
        self._parts.append(parts)
        return advantages

    @property
    def rewards(self) -> Tensor:  # [N]
        return torch.cat(self._rewards)

    @property
    def components(self) -> dict[str, Tensor]:  # reward component -> [N]
        return {name: torch.cat([c[name] for c in self._components]) for name in self._components[0]}

    @property
    def advantages(self) -> Tensor:  # [N]
        return torch.cat(self._advantages)

    @property
    def advantage_parts(self) -> dict[str, Tensor]:  # each weighted reward's part [N] of the advantages
        return {name: torch.cat([p[name] for p in self._parts]) for name in self._parts[0]} if self._parts else {}


class Updater:
    def __init__(self, policy, sampling, grpo, jagg, memory, sampler: Sampler):
        self.policy, self.sampling, self.grpo, self.jagg, self.memory = policy, sampling, grpo, jagg, memory
        self.sampler = sampler
        self.estimator = build_estimator(jagg)  # a routed window's draws and fold weights (estimators/)
        # the non-finite checks of every update (nonfinite.py); the optimizer step decides on them
        self.guard = NonFiniteGuard(grpo.max_nonfinite_in_a_row, sampling.group_size)
        self.row_steps: Tensor | None = None  # each sample's trained step, with sampling.sde_window_draw: group

    def objective_state(self) -> dict:  # what the objective keeps beyond the weights, for the checkpoint (GRPO: none)
        return {}

    def load_objective_state(self, state: dict) -> None:  # restores objective_state (GRPO: nothing to restore)
        pass

    def advantages(self, rewards: Tensor, collectives: Collectives | None = None) -> Tensor:
        """Group advantages of rewards [N] laid out prompt-major (``grpo`` settings; global std over all processes)."""
        all_reduce = (collectives or Collectives()).sum
        return group_advantages(rewards.view(-1, self.sampling.group_size), self.grpo.adv_std, self.grpo.adv_eps,
                                self.grpo.adv_clip, self.grpo.std_ddof, all_reduce=all_reduce).flatten()

    def reward_advantages(self, rewards: Tensor, components: dict[str, Tensor], reward: Reward,
                          collectives: Collectives | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Advantages [N] of a scored rollout and each weighted reward's part of them (``grpo.multi_reward``;
        :func:`~jagg_lightning.method.grpo.combined_advantages`); monitors (``MonitoredReward``) have no weight, so
        never enter. "weighted_sum" gives exactly :meth:`advantages` of the total."""
        weights = component_weights(reward)
        if weights is None and len(components) == 1:
            weights = dict.fromkeys(components, 1.0)
        if self.grpo.multi_reward == "per_reward" and (weights is None or not set(weights) <= set(components)):
            raise ValueError(f"grpo.multi_reward 'per_reward' needs the weight of every reward, but reward "
                             f"{reward.name} ({type(reward).__name__}) reports components {sorted(components)} "
                             "without them (a served WeightedReward): put one RemoteReward per served reward in a "
                             "local WeightedReward, or use 'weighted_sum'")
        if weights is not None and not set(weights) <= set(components):
            weights = None  # the reward reports other components than it weights: no parts to show
        g = self.grpo
        all_reduce = (collectives or Collectives()).sum
        return combined_advantages(rewards, components, weights, self.sampling.group_size, g.multi_reward, g.adv_std,
                                   g.adv_eps, g.adv_clip, g.std_ddof, all_reduce)

    def route(self, traj: Trajectory, windows: list[Window], collectives: Collectives | None = None, step: int = 0,
              draw: int = 0) -> list[Window]:
        """Score every window from the recorded velocities (``jagg.routing``; mean over all samples of all
        processes), route and let the estimator (``jagg.estimator``) make its draws (the control variate's B; in place;
        the windows are returned). ``random`` scores and the draws come from generators seeded by (the rollout stream's
        seed, ``step``, ``draw``: the fused mode's micro-batch), alike on every process; the global RNG is untouched."""
        gen = torch.Generator().manual_seed(sample_seed(self.sampling.seed, step, _ROUTING_STREAM, draw))
        scores = torch.stack([routing_score(self.jagg.routing, traj.velocities, traj.times, w.steps, gen)
                              for w in windows]).to(self.sampler.device)
        if self.jagg.routing != "random":  # drawn alike everywhere; measured scores differ per process
            # every process must route alike: under DDP the backward calls (and their all-reduces) must match
            scores = (collectives or Collectives()).mean(scores)
        route_windows(windows, scores.tolist(), self.jagg.jagg_frac, self.jagg.window_size, self.jagg.score_limit)
        gen = torch.Generator().manual_seed(sample_seed(self.sampling.seed, step, _CONTROL_STREAM, draw))
        self.estimator.draw(windows, gen)
        return windows

    @torch.no_grad()
    def complete_reference(self, traj: Trajectory, cond: tuple, windows: list[Window], taken: set[int]) -> int:
        """Fill in, once the windows are routed, the reference velocities the rollout did not take
        (``interpolate_reference``): a routed window's interior steps are interpolated from its anchors'
        (alpha_k of the window), an exact window's are taken with the adapter off. In place; returns the
        adapter-off forwards it made."""
        ref, forwards = traj.ref_velocities, 0
        if ref is None:
            return 0
        for w in windows:
            missing = [k for k in w.interior if k not in taken]
            if missing and w.routed:
                alpha = alphas(traj.times, w.steps)
                a, b = w.anchors
                for i, k in enumerate(w.steps):
                    if k in missing:
                        ref[k] = (1 - alpha[i]).to(ref.dtype) * ref[a] + alpha[i].to(ref.dtype) * ref[b]
            else:
                for k in missing:
                    forwards += self.sampler.reference_at_step(traj, cond, k, ref)
        return forwards

    # ------------------------------------------------------------------ the engine
    reads_old_velocity = False  # whether the step loss reads the rollout's velocity (Flow-DPPO's mask: always)

    def record_loss(self, v: Tensor, record: StepRecord):
        """One step's per-sample loss [B] and statistics: GRPO's clipped surrogate (Flow-DPPO overrides this)."""
        g, s = self.grpo, self.sampling
        return step_loss(v, record, s.step_kind, s.noise_level, g.clip_range, g.kl_beta, s.cps_log_prob,
                         g.kl_convention, g.ratio_norm, g.ratio_reweight)

    def step_loss_fn(self, mb: Trajectory, advantages: Tensor, ref_v: Tensor | None, scale: float, stats: list,
                     samples: Tensor | None = None):
        """(k, v) -> step k's share of the objective, (k, stats) to ``stats``; ``samples``: rows the guard checks."""
        kind, g, s = self.sampling.step_kind, self.grpo, self.sampling
        times = mb.times.tolist()  # one host read per micro-batch, not two per step
        # Flash-GRPO's temporal rectification: a fixed weight per step, from the schedule alone (grpo.py)
        weights = rectification_weights(times, s.trainable_steps, s.trainable_steps, kind, s.noise_level,
                                        s.cps_log_prob) if g.temporal_rectification else {}

        def loss_of_step(k: int, v: Tensor) -> Tensor:
            record = StepRecord(
                mb.latents[k], mb.latents[k + 1], times[k], times[k + 1], mb.log_probs[k],
                advantages, None if ref_v is None else ref_v[k],
                mb.velocities[k] if g.ratio_norm or self.reads_old_velocity else None, weights.get(k, 1.0),
            )
            loss, st = self.record_loss(v, record)
            stats.append((k, st))
            if samples is not None:
                self.guard.check_loss(samples, loss)
            return loss.mean() * scale

        return loss_of_step

    def backward_samples(self, mb: Trajectory, advantages: Tensor, cond: tuple, update_size: int, plan: RolloutPlan,
                         windows: list[Window], first_update: bool, stats: list, backward,
                         samples: Tensor | None = None) -> list[WindowRecord]:
        """The engine over ``mb``'s samples, in passes of as many samples as ``memory.budget_mb`` allows
        (:func:`~jagg_lightning.training.passes.pass_plan`); each sample's loss is scaled by 1 / (update_size * trained steps).
        ``first_update``: theta is still the rollout's theta_old (:meth:`engine_pass`). ``samples``: ``mb``'s rows of
        the rollout (the guard's loss check)."""
        if self.row_steps is not None and samples is not None:  # group draws: each sample's pass at its own step
            return self.backward_by_step(mb, advantages, cond, update_size, plan, first_update, stats, backward, samples)
        size, split_anchors = pass_plan(advantages.shape[0], windows, self.memory, self.sampler.activation_bytes)
        records = []
        for start in range(0, advantages.shape[0], size):
            rows = slice(start, start + size)
            records += self.engine_pass(mb.select(rows), advantages[rows], batch_slice(cond, rows), update_size, plan,
                                        windows, first_update, stats, split_anchors, backward,
                                        samples=None if samples is None else samples[rows])
        return records

    def backward_by_step(self, mb: Trajectory, advantages: Tensor, cond: tuple, update_size: int, plan: RolloutPlan,
                         first_update: bool, stats: list, backward, samples: Tensor) -> list[WindowRecord]:
        """``sde_window_draw: group``: one exact pass per drawn step on its rows (loss 1 / (update_size x 1 step))."""
        steps, records = self.row_steps.to(samples.device)[samples], []
        for k in sorted(set(steps.tolist())):
            rows = (steps == k).nonzero().flatten()
            window = next(w for w in plan.windows if w.steps == (k,))
            records += self.engine_pass(mb.select(rows), advantages[rows], batch_slice(cond, rows), update_size, plan,
                                        [window], first_update, stats, False, backward, samples=samples[rows])
        return records

    def engine_pass(self, mb: Trajectory, advantages: Tensor, cond: tuple, update_size: int, plan: RolloutPlan,
                    windows: list[Window], first_update: bool, stats: list, split_anchors: bool, backward,
                    graphs: dict[int, Tensor] | None = None, samples: Tensor | None = None):
        """One :func:`accumulate_gradients` call over all of ``mb``'s samples. ``first_update`` (theta is still the
        rollout's theta_old) means two things: the interiors' g_k come from the rollout's recorded velocities
        (``interior_cache``, with ``jagg.cache_interior``), and each anchor takes a forward of its own at the
        rollout's batch shape (not ``batch_anchors``), so the recomputed log-probs are the rollout's bit for bit
        (ratio exactly 1); its two anchors still share ONE backward unless ``split_anchors``."""
        interior_cache = mb.velocities if first_update and self.jagg.cache_interior else None
        batch_anchors = not first_update
        scale = advantages.shape[0] / (update_size * plan.steps_per_sample)
        loss_of_step = self.step_loss_fn(mb, advantages, mb.ref_velocities, scale, stats, samples)
        return accumulate_gradients(
            self.sampler.velocity, mb.latents, mb.times, cond, loss_of_step, windows, cached_velocities=interior_cache,
            low_memory=split_anchors, backward=backward, graphs=graphs, batch_anchors=batch_anchors,
            interior_terms=self.estimator.interior_terms,
        )

    def drop_zero_advantage(self, group: list[Tensor], advantages: Tensor,
                            collectives: Collectives) -> tuple[list[Tensor], int]:
        """The micro-batches of one update without the samples whose advantage is exactly 0, repacked into
        micro-batches of ``train_batch_size`` (when kl_beta = 0 they contribute nothing, so the update,
        which keeps its full-size normalisation, is the same), and how many samples were skipped. Every process
        makes as many micro-batches as the process with the most under a sharded strategy -- a short one pads
        with single zero-advantage samples (zero gradient) -- so the collectives inside the passes (FSDP's
        all-gathers) stay matched."""
        if not self.grpo.skip_zero_advantage or self.grpo.kl_beta > 0:
            return group, 0
        index = torch.cat(group)
        nonzero = advantages[index] != 0
        keep, zero = index[nonzero], index[~nonzero]
        kept = list(keep.split(self.grpo.train_batch_size)) if len(keep) else []
        count = collectives.max_count_if_sharded(torch.tensor(len(kept), device=self.sampler.device))
        padding = int(count) - len(kept)
        kept += [zero[i : i + 1] for i in range(padding)]
        return kept, len(zero) - padding

    def check_windows(self, batch: RolloutBatch, plan: RolloutPlan, params: list[torch.nn.Parameter],
                      max_samples: int | None = None) -> list[WindowGradientCheck]:
        """Exact vs JAGG gradient of every window of ``plan`` on the first ``max_samples`` samples of ``batch``,
        at the current theta (:func:`~jagg_lightning.method.jagg.check_window_gradients`; ``.grad`` untouched)."""
        index = torch.arange(batch.advantages.shape[0], device=batch.advantages.device)[:max_samples]
        mb = batch.trajectory.select(index)
        loss_of_step = self.step_loss_fn(mb, batch.advantages[index], mb.ref_velocities, 1.0 / len(plan.trained_steps), [])
        return check_window_gradients(self.sampler.velocity, params, mb.latents, mb.times,
                                      batch_slice(batch.cond, index), loss_of_step, plan.windows)

    # ------------------------------------------------------------------ the step
    def step(self, prompts: list[str], indices: list[int], step: int, plan: RolloutPlan, reward: Reward,
             hooks: UpdateHooks) -> StepReport:
        """One training step's rollout and update, fused or unfused (the module docstring).

        Fused: as each rollout micro-batch of n samples (whole groups) is scored -- its groups' advantages, its
        windows routed on its own recorded velocities (mean over the processes), its reference completed, and ONE
        backward over its kept graphs (:meth:`fused_backward`) -- then one optimizer step. With ``reward_workers``
        > 0 a micro-batch is scored in the reward pool while the next one samples, and updated once that one is
        sampled (the same backward calls in the same order; the graphs of two micro-batches are held meanwhile).
        """
        fused = self.jagg.fused_rollout
        taken = reference_steps(plan.windows, self.jagg)
        cond = self.sampler.encode(prompts)
        graph_steps = fused_graph_steps(plan.windows, self.jagg, self.memory) if fused else set()
        graph_samples = fused_samples(len(graph_steps), self.memory, self.sampler.activation_bytes) if fused else None
        # Flash-GRPO's iso-temporal groups (sampling.sde_window_draw: group): each sample at its prompt's own step
        self.row_steps = None if self.sampling.sde_window_draw != "group" else torch.tensor(
            group_steps(self.sampling, step, indices)).repeat_interleave(self.sampling.group_size)
        rollout = self.sampler.rollout(cond, indices, step, plan.step_kinds, sorted(taken), graph_steps, graph_samples,
                                       None if self.row_steps is None else self.row_steps.tolist())
        sample_prompts = [p for p in prompts for _ in range(self.sampling.group_size)]
        report = StepReport(cond)
        self.guard.start_rollout(indices, self.sampler.device)
        ahead = (1 if self.sampler.reward_workers else 0) if fused else None  # unfused: the update needs them all
        for index, scored in enumerate(self.sampler.scored(rollout, reward, sample_prompts, ahead)):
            # the same micro-batches on every process: a stop here is agreed by all of them
            hooks.safe_point(f"rollout micro-batch {index + 1} (sampled and scored)")
            report.add_scored(scored)
            self.guard.check_rollout(scored.rows, scored.sampled.final)
            self.guard.check_rewards(scored.rows, scored.rewards, scored.components)
            if not fused:
                continue
            # group std (check_fused): this micro-batch's groups alone
            advantages = report.add_advantages(*self.reward_advantages(scored.rewards, scored.components, reward,
                                                                       hooks.collectives))
            self.guard.check_advantages(scored.rows, advantages)
            self.guard.train(scored.rows)  # the fused mode's one update takes every sample
            mb, mb_cond = scored.sampled.part, batch_slice(cond, scored.rows)  # views: the trajectory's
            windows = self.route(mb, plan.windows, hooks.collectives, step, scored.rows.start)
            report.reference_forwards += self.complete_reference(mb, mb_cond, windows, taken)
            with CLOCK.phase("update/forward"):  # its backwards: update/backward (hooks.backward)
                self.fused_backward(scored.sampled, mb_cond, advantages, len(sample_prompts), plan, windows, hooks,
                                    report)
        if fused:
            hooks.optimizer_step()
            report.micro_batches = -(-len(sample_prompts) // self.sampling.rollout_batch_size)
        else:
            hooks.safe_point("the rollout's end, before the update")
            with CLOCK.phase("update/forward"):  # its backwards and optimizer steps: their own phases (hooks)
                self.update_rollout(report, plan, taken, step, reward, hooks)
        report.exact_backwards = plan.steps_per_sample * report.micro_batches
        return report

    def fused_backward(self, sampled: SampledMicroBatch, cond: tuple, advantages: Tensor, num: int, plan: RolloutPlan,
                       windows: list[Window], hooks: UpdateHooks, report: StepReport) -> None:
        """ONE backward over the micro-batch's kept graphs, its interiors' g_k folded in from the recorded
        velocities (each sample's loss scaled by 1 / (``num`` * trained steps), as the unfused update); samples
        beyond the kept ones go through the unfused engine (interiors from the cache). All groups tied (zero
        advantage, kl_beta 0): no backward, a zero gradient (its forwards were the rollout's). Its graphs, kept and
        unused (a routed window's interiors), are released after the backward, before the next micro-batch samples."""
        mb, n, kept = sampled.part, advantages.shape[0], sampled.graph_rows
        samples = torch.arange(sampled.rows.start, sampled.rows.start + n, device=advantages.device)
        if self.grpo.skip_zero_advantage and self.grpo.kl_beta == 0 and not bool(advantages.any()):
            report.skipped_samples += n
            sampled.graphs.clear()
            return
        with hooks.collectives.local_backward():
            rows = slice(0, kept)
            try:
                report.records += self.engine_pass(mb.select(rows), advantages[rows], batch_slice(cond, rows), num,
                                                   plan, windows, True, report.first_update_stats,
                                                   self.memory.anchors == "split", hooks.backward, sampled.graphs,
                                                   samples[rows])
            finally:
                sampled.graphs.clear()
            if kept < n:  # the samples without kept graphs: the unfused engine, interiors from the cache
                rows = slice(kept, n)
                report.records += self.backward_samples(mb.select(rows), advantages[rows], batch_slice(cond, rows), num,
                                                        plan, windows, True, report.first_update_stats, hooks.backward,
                                                        samples[rows])

    def update_rollout(self, report: StepReport, plan: RolloutPlan, taken: set[int], step: int, reward: Reward,
                       hooks: UpdateHooks) -> None:
        """The unfused update of the finished rollout: advantages, routing, the completed reference, then
        ``inner_epochs`` passes over shuffled micro-batches, one optimizer step per update."""
        traj, cond = report.trajectory, report.cond
        advantages = report.add_advantages(*self.reward_advantages(report.rewards, report.components, reward,
                                                                   hooks.collectives))
        self.guard.check_advantages(slice(None), advantages)
        self.route(traj, plan.windows, hooks.collectives, step)
        report.reference_forwards += self.complete_reference(traj, cond, plan.windows, taken)
        num = advantages.shape[0]
        shuffle = torch.Generator().manual_seed(sample_seed(self.sampling.seed, step, -1))
        theta_is_old = True
        for _ in range(self.grpo.inner_epochs):
            for group in shuffled_updates(num, self.grpo, shuffle, self.sampler.device):
                update_size = sum(len(m) for m in group)
                for index in group:
                    self.guard.train(index)
                group, skipped = self.drop_zero_advantage(group, advantages, hooks.collectives)
                report.skipped_samples += skipped
                with hooks.collectives.local_backward():
                    for index in group:
                        # this micro-batch's share of d(mean loss over the update)/dtheta
                        report.records += self.backward_samples(
                            traj.select(index), advantages[index], batch_slice(cond, index), update_size, plan,
                            plan.windows, theta_is_old, report.first_update_stats if theta_is_old else report.stats,
                            hooks.backward, index)
                hooks.optimizer_step()
                theta_is_old = False
        report.micro_batches = self.grpo.inner_epochs * -(-num // self.grpo.train_batch_size)
